"""Run a sorter's balancing of step t while the training loop computes step t + 1.

The next epoch's order is needed only when the epoch ends, so `sorter.step` can lag one step
behind the loop. `BackgroundSorter` hands each step to one worker thread (the CPU sign loop is
compiled code that releases the GIL; on CUDA the thread issues its kernels on a side stream), and
joins it before anything reads the sorter: the next step, `sort()`, `state_dict()`. The sorter
sees exactly the same calls in the same order, so orders are bit-identical to the sequential path.

The caller must keep each step's gradients intact until the step after next has been submitted
(the engine double-buffers per-unit gradients when overlapping).

CUDA memory. The caching allocator recycles a freed block on the stream that allocated it without
waiting for other streams, so each tensor handed to the side stream is recorded on it
(`Tensor.record_stream`): under torchrun the all-gather output is a fresh main-stream tensor every
step, which the loop drops at once and the thread drops as soon as its kernels are queued (not
run). The sorter's own state (running sums, orders) is allocated on the main stream and only
replaced by `sort()` / `load_state_dict()`, after the main stream has waited for the side stream.
What the sorter allocates on the side stream and keeps (the cached first unit of a pair) is
reused only by later steps, whose kernels wait for everything the main stream queued before them.
"""
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

    def __getattr__(self, name):  # name, uses_grads, ...: read through
        return getattr(self.sorter, name)

    def step(self, grads, positions) -> None:
        self.wait()
        if self.side_stream is None:
            self.pending = self.pool.submit(self.sorter.step, grads, positions)
            return
        if grads is not None:
            # else, once the loop and the thread drop grads, its block may be handed to the next step's
            # main-stream tensors while the side stream still reads it
            grads.record_stream(self.side_stream)
        ready = torch.cuda.Event()
        ready.record()  # the gradients exist once the main stream gets here

        def on_side_stream():
            with torch.cuda.stream(self.side_stream):
                self.side_stream.wait_event(ready)
                self.sorter.step(grads, positions)
                self.done = torch.cuda.Event()
                self.done.record()

        self.pending = self.pool.submit(on_side_stream)

    def wait(self) -> None:
        """Block until the submitted step has run (re-raising its error); on CUDA, make the main
        stream wait for its kernels too, so later work may overwrite the gradients it read."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()
            if self.done is not None:
                torch.cuda.current_stream().wait_event(self.done)

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
