"""--overlap's BackgroundSorter on the CPU: its steps are timed where they run, and metrics.csv's
sorter_seconds means the sorter's own time with and without --overlap. The CUDA branch runs here
against recording stand-ins for torch.cuda; tests/test_overlap_cuda.py runs it on a real GPU."""
import threading
import time

import pytest
import torch

from engine import overlap as overlap_module
from engine import run_setup as run_setup_module
from engine import train as train_module
from engine.comm import LocalCommunicator
from engine.overlap import BackgroundSorter
from sorters import build_sorter
from tests.test_device import ToyRegression, toy_args

CPU = torch.device("cpu")
STEP_SECONDS = 0.05


class SleepingSorter:
    """A stand-in sorter whose step sleeps `seconds` (in whatever thread runs it)."""

    name, uses_grads = "sleeping", True

    def __init__(self, seconds: float):
        self.seconds = seconds

    def step(self, grads, positions):
        time.sleep(self.seconds)


def test_steps_that_finish_while_the_loop_computes_are_timed_in_the_thread():
    background = BackgroundSorter(SleepingSorter(STEP_SECONDS), CPU)
    for t in range(4):
        background.step(None, range(t, t + 1))
        time.sleep(3 * STEP_SECONDS)  # the loop's own work: the step is done before the next hand-off
    steps, waited = background.take_seconds()
    assert steps >= 4 * STEP_SECONDS
    assert waited < STEP_SECONDS
    assert background.take_seconds() == (0.0, 0.0)  # counted once: since the last call
    background.close()


def test_a_step_slower_than_the_loop_makes_the_next_hand_off_wait_and_says_how_long():
    background = BackgroundSorter(SleepingSorter(STEP_SECONDS), CPU)
    for t in range(4):
        background.step(None, range(t, t + 1))  # no work in between: each hand-off waits for the last step
    steps, waited = background.take_seconds()
    assert steps >= 4 * STEP_SECONDS
    assert 3 * STEP_SECONDS * 0.8 <= waited <= steps  # the three later hand-offs waited about one step each
    background.close()


class SlowSteps:
    """Wraps a sorter: every step first sleeps `seconds`."""

    def __init__(self, sorter, seconds: float):
        self.sorter, self.seconds = sorter, seconds

    def __getattr__(self, name):
        return getattr(self.sorter, name)

    def step(self, grads, positions):
        time.sleep(self.seconds)
        self.sorter.step(grads, positions)


def toy_sorter_seconds(tmp_path, monkeypatch, overlap: str, compute_seconds: float) -> float:
    """sorter_seconds of one epoch (4 steps) of the toy regression whose sorter steps take
    STEP_SECONDS each and whose per-unit gradients take compute_seconds per step."""
    monkeypatch.setattr(run_setup_module, "build_sorter",
                        lambda *a, **k: SlowSteps(build_sorter(*a, **k), STEP_SECONDS))
    args = toy_args(tmp_path / f"{overlap}-{compute_seconds}")
    args.overlap = overlap
    task = ToyRegression(CPU)
    unit_grads = task.unit_grads
    task.unit_grads = lambda *a: (time.sleep(compute_seconds), unit_grads(*a))[1]
    (row,) = train_module.train(task, args, LocalCommunicator(2), CPU)
    return row["sorter_seconds"]


@pytest.mark.parametrize("compute_seconds", [0.0, 3 * STEP_SECONDS], ids=["loop-faster", "loop-slower"])
def test_sorter_seconds_is_the_sorters_own_time_with_and_without_overlap(tmp_path, monkeypatch, compute_seconds):
    """With the loop slower than the sorter the steps hide behind it (the loop's timer sees only
    hand-offs: without the thread's timing the column read about 0); with the loop faster, each
    hand-off waits for the previous step (counted by both timers unless the wait is taken out)."""
    steps_seconds = 4 * STEP_SECONDS
    off = toy_sorter_seconds(tmp_path, monkeypatch, "off", compute_seconds)
    on = toy_sorter_seconds(tmp_path, monkeypatch, "on", compute_seconds)
    assert off >= steps_seconds and on >= steps_seconds
    assert on == pytest.approx(off, abs=steps_seconds / 3)


# ---------------------------------------------------------------- the CUDA branch, against stand-ins
class Recorder:
    """Stand-ins for the torch.cuda pieces BackgroundSorter uses; `log` lists what happened, in order."""

    def __init__(self):
        self.log, self.local = [], threading.local()
        self.main, self.side = self.FakeStream(self, "main"), None
        recorder = self

        class Event:
            def __init__(self, enable_timing=False):
                self.timing, self.stream = enable_timing, None

            def record(self):
                self.stream = recorder.current_stream()

            def synchronize(self):
                recorder.log.append(("synchronize", self.stream.name))

            def elapsed_time(self, end):  # milliseconds, like CUDA's: every interval lasts one second here
                assert self.timing and end.timing and self.stream is end.stream
                return 1000.0

        self.Event = Event

    class FakeStream:
        def __init__(self, recorder, name):
            self.recorder, self.name = recorder, name

        def wait_event(self, event):
            self.recorder.log.append((f"{self.name} waits", event.stream.name, event.timing))

    def Stream(self, device):
        self.side = self.FakeStream(self, f"side {device}")
        return self.side

    def current_stream(self):
        return getattr(self.local, "stream", self.main)

    def stream(self, stream):
        recorder = self

        class Context:
            def __enter__(self):
                recorder.local.stream = stream

            def __exit__(self, *exc):
                recorder.local.stream = recorder.main

        return Context()


class RecordedGradients:
    def __init__(self, log):
        self.log = log

    def record_stream(self, stream):
        self.log.append(("record_stream", stream.name))


class LoggingSorter:
    name, uses_grads = "logging", True

    def __init__(self, recorder):
        self.recorder = recorder

    def step(self, grads, positions):
        self.recorder.log.append(("step", positions.start, self.recorder.current_stream().name))


def test_on_cuda_gradients_are_recorded_on_the_side_stream_and_steps_timed_by_its_events(monkeypatch):
    """Before a step is handed to the side stream its gradients are recorded on that stream (else the
    caching allocator may give their memory to new main-stream tensors while the side stream still
    reads it); the steps are bracketed by timing events on the side stream and the waits by events on
    the main stream, which are read only by take_seconds()."""
    cuda = Recorder()
    for name in ("Event", "Stream", "stream", "current_stream"):
        monkeypatch.setattr(overlap_module.torch.cuda, name, getattr(cuda, name))
    background = BackgroundSorter(LoggingSorter(cuda), torch.device("cuda", 1))
    for t in range(3):
        background.step(RecordedGradients(cuda.log), range(t, t + 1))
    background.wait()
    side = "side cuda:1"
    first_step = [("record_stream", side), (f"{side} waits", "main", False), ("step", 0, side)]
    assert cuda.log[:3] == first_step
    assert [entry for entry in cuda.log if entry[0] == "step"] == [("step", t, side) for t in range(3)]
    assert cuda.log.count(("main waits", side, True)) == 3  # after each step, before later main work
    assert not any(entry[0] == "synchronize" for entry in cuda.log)  # no host wait inside the epoch
    assert background.take_seconds() == (3.0, 2.0)  # three steps; the 2nd and 3rd hand-offs waited
    assert cuda.log[-2:] == [("synchronize", side), ("synchronize", "main")]
