"""--overlap's BackgroundSorter on a real GPU; skipped where no CUDA device is visible.

The race it had under torchrun: the all-gather hands the sorter a fresh main-stream tensor each
step, the loop drops it at once and the worker thread as soon as it has queued the side stream's
kernels. The caching allocator then gives that memory to the next main-stream tensor of the same
size, which the main stream fills while the side stream has not read it yet, unless the tensor was
recorded on the side stream (`Tensor.record_stream`). Here a stand-in sorter keeps the side stream
busy (`torch.cuda._sleep`) before summing the gradients, and the main stream overwrites the freed
memory meanwhile: the sum is right only if the allocator held the memory back.

The steps are also timed by events on the side stream, and the hand-offs' waits on the main stream.
"""
import time

import pytest
import torch

from engine.overlap import BackgroundSorter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device is visible: these tests need the CUDA caching allocator "
                                       "and streams (run them on a GPU machine)")
GPU = torch.device("cuda", 0)
SHAPE = (4, 8, 131_072)  # (n, k, d): 16 MiB of float32, a segment of its own in the caching allocator
SLEEP_CYCLES = 200_000_000  # GPU clock cycles each step keeps the side stream busy before reading
STEPS = 3
GRADS_BYTES = torch.Size(SHAPE).numel() * 4
EXPECTED_SUM = float(torch.Size(SHAPE).numel() * sum(range(1, STEPS + 1)))  # exact in float64


class SlowSumSorter:
    """A stand-in sorter: step keeps the current stream busy, then adds the gradients' sum to
    `total` (float64, on the GPU), so it reads them long after BackgroundSorter.step returned."""

    name, uses_grads = "slow-sum", True

    def __init__(self):
        self.total = torch.zeros((), dtype=torch.float64, device=GPU)

    def step(self, grads, positions):
        torch.cuda._sleep(SLEEP_CYCLES)
        self.total += grads.sum(dtype=torch.float64)


def wait_until_freed(below: int, timeout: float = 30.0) -> None:
    """Until the caching allocator counts fewer than `below` bytes in use on the GPU."""
    deadline = time.monotonic() + timeout
    while torch.cuda.memory_allocated(GPU) >= below:
        assert time.monotonic() < deadline, "the worker thread never dropped the gradients"
        time.sleep(0.001)


def overlapped_sum() -> float:
    """Hand STEPS fresh gradient tensors (all ones, twos, ...) to a BackgroundSorter as the loop
    does under torchrun, overwrite their memory as soon as it is freed, and return the sorter's sum."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no other free block of this size: a freed one is reused at once
    sorter = SlowSumSorter()
    background = BackgroundSorter(sorter, GPU)
    for step in range(STEPS):
        grads = torch.full(SHAPE, float(step + 1), device=GPU)  # a fresh main-stream tensor, like the all-gather's
        in_use = torch.cuda.memory_allocated(GPU)
        background.step(grads, range(step, step + 1))
        del grads  # as the loop does
        # once the thread has queued its kernels and let go of the gradients: the next step's work
        # takes a tensor of the same size and overwrites it while the side stream still sleeps
        wait_until_freed(in_use - GRADS_BYTES // 2)
        torch.full(SHAPE, -1.0, device=GPU)
    background.close()
    torch.cuda.synchronize()
    return sorter.total.item()


def test_the_side_stream_reads_the_gradients_it_was_handed():
    """Fails when BackgroundSorter.step does not record the gradients on the side stream."""
    assert overlapped_sum() == EXPECTED_SUM


def test_without_record_stream_the_freed_gradients_are_overwritten(monkeypatch):
    """The hazard is real: with record_stream a no-op, the same steps sum overwritten memory. (If
    this fails, the scenario no longer makes the allocator reuse the block, and the test above
    proves nothing.)"""
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    assert overlapped_sum() != EXPECTED_SUM


def sleep_seconds() -> float:
    """How long one step's torch.cuda._sleep takes on the main stream now."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def test_side_stream_steps_and_the_hand_offs_waits_are_timed():
    """take_seconds(): the side stream's time of each step, and how long the main stream stalled
    waiting for the previous step (three steps back to back: the 2nd and 3rd hand-offs waited)."""
    before = sleep_seconds()
    background = BackgroundSorter(SlowSumSorter(), GPU)
    grads = torch.ones(SHAPE, device=GPU)
    for step in range(STEPS):
        background.step(grads, range(step, step + 1))
    steps, waited = background.take_seconds()
    slept = min(before, sleep_seconds())  # the sleep counts clock cycles: the shorter, at the higher clock
    assert steps >= 0.9 * STEPS * slept
    assert 0.5 * (STEPS - 1) * slept <= waited <= steps
    assert background.take_seconds() == (0.0, 0.0)
    background.close()
