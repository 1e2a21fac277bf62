"""Run a sorter's balancing of step t while the training loop computes step t + 1.

The next epoch's order is needed only when the epoch ends, so `sorter.step` can lag one step
behind the loop. `BackgroundSorter` hands each step to one worker thread (the CPU sign loop is
compiled code that releases the GIL; on CUDA the thread issues its kernels on a side stream), and
joins it before anything reads the sorter: the next step, `sort()`, `state_dict()`. The sorter
sees exactly the same calls in the same order, so orders are bit-identical to the sequential path.

The caller must keep each step's gradients intact until the step after next has been submitted
(the engine rotates one more per-unit gradient buffer when overlapping: engine/task.py grad_buffers).

CUDA memory. The caching allocator recycles a freed block on the stream that allocated it without
waiting for other streams, so each tensor handed to the side stream is recorded on it
(`Tensor.record_stream`): under torchrun the all-gather output is a fresh main-stream tensor every
step, which the loop drops at once and the thread drops as soon as its kernels are queued (not
run). The sorter's own state (running sums, orders) is allocated on the main stream and only
replaced by `sort()` / `load_state_dict()`, after the main stream has waited for the side stream.
What the sorter allocates on the side stream and keeps (the cached first unit of a pair) is
reused only by later steps, whose kernels wait for everything the main stream queued before them.

Timing. The loop's own timer sees only the hand-off, so the steps time themselves: on the CPU the
thread's wall time, on CUDA events on the side stream, read in `take_seconds()` at the epoch's end
(no host synchronisation inside a step). The time `step()` spends waiting for the previous step is
measured too: the loop's timer has already counted it.
"""
import time
from concurrent.futures import ThreadPoolExecutor

import torch


class BackgroundSorter:
    """Wraps a Sorter: `step` returns at once; every other method first waits for the pending step."""

    def __init__(self, sorter, device: torch.device):
        self.sorter = sorter
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sorter")
        self.pending = None
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.done = None  # CUDA: event recorded on the side stream after the last step's kernels
        # (start, end) clock readings since take_seconds(): perf_counter floats, CUDA timing events
        self.step_intervals = []  # around each sorter.step (on the side stream on CUDA)
        self.wait_intervals = []  # around each wait of step() for the previous step (main stream)

    def __getattr__(self, name):  # name, uses_grads, ...: read through
        return getattr(self.sorter, name)

    def step(self, grads, positions) -> None:
        """Queue sorter.step(grads, positions); grads: (n, k, d) every worker's unit gradients."""
        self._wait(timed=True)
        if self.side_stream is None:
            self.pending = self.pool.submit(self._step_in_thread, grads, positions)
            return
        if grads is not None:
            # else, once the loop and the thread drop grads, its block may be handed to the next step's
            # main-stream tensors while the side stream still reads it
            grads.record_stream(self.side_stream)
        ready = torch.cuda.Event()
        ready.record()  # the gradients exist once the main stream gets here
        self.pending = self.pool.submit(self._step_on_side_stream, grads, positions, ready)

    def _step_in_thread(self, grads, positions) -> None:
        start = time.perf_counter()
        self.sorter.step(grads, positions)
        self.step_intervals.append((start, time.perf_counter()))

    def _step_on_side_stream(self, grads, positions, ready) -> None:
        with torch.cuda.stream(self.side_stream):
            self.side_stream.wait_event(ready)
            start = self._clock()
            self.sorter.step(grads, positions)
            self.done = self._clock()
        self.step_intervals.append((start, self.done))

    def _clock(self):
        """Now, on the CPU; on CUDA an event recorded on the current stream."""
        if self.side_stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self) -> None:
        """Block until the submitted step has run (re-raising its error); on CUDA, make the main
        stream wait for its kernels too, so later work may overwrite the gradients it read."""
        self._wait(timed=False)

    def _wait(self, timed: bool) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        start = self._clock() if timed else None
        pending.result()
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)
        if timed:
            self.wait_intervals.append((start, self._clock()))

    def take_seconds(self) -> tuple[float, float]:
        """(seconds the steps took, seconds step() waited for a previous step), both since the last
        call; waits for the pending step first. On CUDA this synchronises with the device once."""
        self.wait()
        steps, self.step_intervals = self.step_intervals, []
        waits, self.wait_intervals = self.wait_intervals, []
        return self._seconds(steps), self._seconds(waits)

    def _seconds(self, intervals) -> float:
        if self.side_stream is None:
            return sum(end - start for start, end in intervals)
        if intervals:
            intervals[-1][1].synchronize()  # events of one stream complete in order
        return sum(start.elapsed_time(end) for start, end in intervals) / 1000

    def sort(self):
        self.wait()
        return self.sorter.sort()

    def state_dict(self):
        self.wait()
        return self.sorter.state_dict()

    def load_state_dict(self, state):
        self.wait()
        self.sorter.load_state_dict(state)

    def close(self) -> None:
        self.wait()
        self.pool.shutdown()
