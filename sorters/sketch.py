"""GradientSketch: a fixed random linear map R^d -> R^D under which the balancing sorters can run.

    sketch = GradientSketch(d, 256, seed=0)   # the same map in every process and on every device
    s = sketch(grads)                         # (..., d) -> (..., 256)

CD-GraB only reads inner products <S, v> of its running sum S with pair differences v, and both are
linear in the gradients, so balancing the sketches P g instead of the gradients g is the same
algorithm run on <P S, P v>, an unbiased estimate of <S, v>. Each worker sketches its own per-unit
gradients before the all-gather: every process then receives n * k * D floats per step instead of
n * k * d (docs/sketching.md).
"""
import torch

# the sketch's generator seed is the run seed shifted by this, so that its random stream never
# coincides with the stream of the sorter's first orders (torch.Generator().manual_seed(seed))
SEED_OFFSET = 0x5EED_5EED
CHUNK_BYTES = 32 * 2**20  # the signed copy of the input is made this many bytes at a time


class GradientSketch:
    """CountSketch (Charikar, Chen & Farach-Colton 2002): coordinate i of the input is added, with a
    random sign s_i in {-1, +1}, to output coordinate h_i in {0, ..., D-1}:

        (P x)_c = sum_{i : h_i = c} s_i x_i,     x (..., d) -> P x (..., D).

    The h_i (uniform) and s_i (uniform) are all independent, drawn on the CPU from a torch.Generator
    seeded with seed + SEED_OFFSET, so two constructions with the same (d, dim, seed) give the same
    map in every process and on every device. P is a linear map (a D x d matrix with exactly one
    +-1 per column), never formed.

    Inner products. For any fixed x, y in R^d, <P x, P y> is unbiased, E <P x, P y> = <x, y>, with

        Var <P x, P y> = ( ||x||^2 ||y||^2 + <x, y>^2 - 2 sum_i x_i^2 y_i^2 ) / D,

    (at most 2 ||x||^2 ||y||^2 / D; the same as a dense Gaussian map's (||x||^2 ||y||^2 + <x,y>^2) / D
    less the diagonal term): the error is about ||x|| ||y|| / sqrt(D), whatever d is.

    Cost. Memory: the table h (int64) and the signs (in the input's dtype) on each device used,
    12 bytes per input coordinate for float32 (GPT-2, d = 7.1M: 85 MB), plus a signed copy of at
    most CHUNK_BYTES of the input at a time. Time: one pass over the input, d multiplications and
    d additions per row. Deterministic: each output is the sum of its inputs in increasing order of
    i (CPU: index_add_; other devices: index_put_ with accumulate, which sorts stably), so a row's
    sketch does not depend on the other rows of the batch, and the same input gives the same
    sketch from run to run.

    Identity. With dim >= d the map is the identity (`is_identity`, `dim` = d): nothing is drawn and
    __call__ returns its input, so balancing on it is exact CD-GraB bit for bit. Also
    `GradientSketch.identity(d)`.
    """

    family = "CountSketch"

    def __init__(self, d: int, dim: int, seed: int = 0):
        if d < 1 or dim < 1:
            raise ValueError(f"GradientSketch: need d >= 1 and dim >= 1, got d={d}, dim={dim}")
        self.d, self.seed = d, seed
        self.is_identity = dim >= d
        self.dim = d if self.is_identity else dim
        self._tables = {}  # (device, dtype) -> (buckets (d,) int64, signs (d,) dtype)
        if not self.is_identity:
            generator = torch.Generator().manual_seed(seed + SEED_OFFSET)
            buckets = torch.randint(0, dim, (d,), generator=generator)
            signs = torch.randint(0, 2, (d,), generator=generator).mul_(2).sub_(1)
            self._tables[(torch.device("cpu"), None)] = (buckets, signs)

    @classmethod
    def identity(cls, d: int) -> "GradientSketch":
        """The identity map of R^d (exact balancing)."""
        return cls(d, d)

    def __repr__(self):
        kind = "identity" if self.is_identity else f"{self.family}, seed {self.seed}"
        return f"GradientSketch(d={self.d}, dim={self.dim}: {kind})"

    def tables(self, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(buckets (d,) int64 h, signs (d,) s in `dtype`) on `device`, moved once and kept."""
        if self.is_identity:
            raise ValueError("GradientSketch: the identity map has no tables")
        device = torch.device(device or "cpu")
        key = (device, dtype)
        if key not in self._tables:
            buckets, signs = self._tables[(torch.device("cpu"), None)]
            self._tables[key] = (buckets.to(device), signs.to(device=device, dtype=dtype))
        return self._tables[key]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., d) -> (..., dim) in x's dtype and on x's device; x itself for the identity."""
        if x.shape[-1:] != (self.d,):
            raise ValueError(f"GradientSketch: input must have shape (..., {self.d}), got {tuple(x.shape)}")
        if self.is_identity:
            return x
        rows = x.detach().reshape(-1, self.d)
        buckets, signs = self.tables(x.device, x.dtype)
        on_cpu = x.device.type == "cpu"
        # the index_put_ path accumulates into rows of a (dim, rows) tensor: the transposed output
        out = rows.new_zeros(rows.shape[0], self.dim) if on_cpu else rows.new_zeros(self.dim, rows.shape[0])
        width = max(1, CHUNK_BYTES // max(1, rows.shape[0] * rows.element_size()))
        for start in range(0, self.d, width):
            cols = slice(start, start + width)
            signed = rows[:, cols] * signs[cols]
            if on_cpu:
                out.index_add_(1, buckets[cols], signed)
            else:  # CUDA's index_add_ adds in any order (atomics); index_put_ sorts first
                out.index_put_((buckets[cols],), signed.T.contiguous(), accumulate=True)
        out = out if on_cpu else out.T.contiguous()
        return out.reshape(*x.shape[:-1], self.dim)

    def matrix(self, dtype=torch.float64) -> torch.Tensor:
        """The map as a dense (dim, d) matrix (for tests and small d only)."""
        if self.is_identity:
            return torch.eye(self.d, dtype=dtype)
        buckets, signs = self._tables[(torch.device("cpu"), None)]
        P = torch.zeros(self.dim, self.d, dtype=dtype)
        P[buckets, torch.arange(self.d)] = signs.to(dtype)
        return P

