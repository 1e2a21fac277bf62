"""Sketch, then gather: how the balancing sorters' per-unit gradients reach every process.

    every = sketch_then_gather(local, sketch)   # (r, ..., d) here -> (world_size * r, ..., D) everywhere

Each process maps its OWN rows to D-dimensional sketches (a `GradientSketch`, sorters/sketch.py) and only
then all-gathers them, so every process receives world_size * r * D floats instead of world_size * r * d
(docs/sketching.md). A sketch is a function of one row at a time, so sketching here and gathering
afterwards gives the same tensor as gathering first and sketching everything, which is what lets one
process hosting all n workers (no gather) reproduce n processes bit for bit.

Both users call it: `CDGraBSampler.step` (rows = this replica's examples of the step) and the engine's
gradient exchange (rows = this process's workers, each (k, d) per-unit gradients).
"""
from typing import Callable

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; GPU images may be older
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def sketch_rows(rows: torch.Tensor, sketch=None) -> torch.Tensor:
    """rows (..., d) -> (..., D): `sketch(rows)` when a sketch is given and the rows are its d wide; else
    `rows` unchanged (no sketch, or rows that are sketches already, (..., D), as a caller may hand them).
    `sketch`: a GradientSketch (or anything with `.d` and a (..., d) -> (..., D) call)."""
    if sketch is None or rows.shape[-1] != sketch.d:
        return rows
    return sketch(rows)


def all_gather_rows(local: torch.Tensor) -> torch.Tensor:
    """local (r, ...) in each process of the default process group -> (world_size * r, ...) in every
    process: process p's rows at p * r ... (p + 1) * r - 1. Every process must call it at the same time
    with the same shape and dtype; the result is made on local's device, in its dtype (NCCL gathers GPU
    tensors)."""
    out = torch.empty((dist.get_world_size() * local.shape[0],) + tuple(local.shape[1:]), dtype=local.dtype,
                      device=local.device)
    _all_gather_single(out, local.contiguous())
    return out


def sketch_then_gather(local: torch.Tensor, sketch=None,
                       gather: Callable[[torch.Tensor], torch.Tensor] | None = all_gather_rows) -> torch.Tensor:
    """local (r, ..., d) or, already sketched, (r, ..., D) -> (n * r, ..., D): this process's rows sketched
    (`sketch_rows`), then gathered with every other process's by `gather` (r, ..., D) -> (n * r, ..., D)
    (default: `all_gather_rows` over the default process group). gather=None: every row lives in this
    process (no process group), the sketched rows themselves are returned (n = 1)."""
    sketched = sketch_rows(local, sketch)
    return sketched if gather is None else gather(sketched)
