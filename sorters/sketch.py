"""GradientSketch: a fixed random linear map R^d -> R^D under which the balancing sorters can run.

    sketch = GradientSketch(d, 256, seed=0)   # the same map in every process and on every device
    s = sketch(grads)                         # (..., d) -> (..., 256)

CD-GraB only reads inner products <S, v> of its running sum S with pair differences v, and both are
linear in the gradients, so balancing the sketches P g instead of the gradients g is the same
algorithm run on <P S, P v>, an unbiased estimate of <S, v>. Each worker sketches its own per-unit
gradients before the all-gather: every process then receives n * k * D floats per step instead of
n * k * d (docs/sketching.md).
"""
from collections.abc import Iterable

import torch

from sorters.checks import check_int, check_seed

# the sketch's generator seed is the run seed shifted by this, so that its random stream never
# coincides with the stream of the sorter's first orders (torch.Generator().manual_seed(seed))
SEED_OFFSET = 0x5EED_5EED
CHUNK_BYTES = 32 * 2**20  # the signed copy of the input is made this many bytes at a time


class GradientSketch:
    """CountSketch (Charikar, Chen & Farach-Colton 2002): coordinate i of the input is added, with a
    random sign s_i in {-1, +1}, to output coordinate h_i in {0, ..., D-1}:

        (P x)_c = sum_{i : h_i = c} s_i x_i,     x (..., d) -> P x (..., D).

    The h_i (uniform) and s_i (uniform) are all independent (outside the tensor-sketched blocks, below),
    drawn on the CPU from a torch.Generator seeded with seed + SEED_OFFSET, so two constructions with the
    same (d, dim, seed) give the same map in every process and on every device. P is a linear map (a D x d
    matrix with exactly one +-1 per column), never formed.

    Inner products. For any fixed x, y in R^d, <P x, P y> is unbiased, E <P x, P y> = <x, y>, with

        Var <P x, P y> = ( ||x||^2 ||y||^2 + <x, y>^2 - 2 sum_i x_i^2 y_i^2 ) / D,

    (at most 2 ||x||^2 ||y||^2 / D; the same as a dense Gaussian map's (||x||^2 ||y||^2 + <x,y>^2) / D
    less the diagonal term): the error is about ||x|| ||y|| / sqrt(D), whatever d is.

    Cost. Memory: h and s kept in 5 bytes per coordinate outside the blocks (int32, int8; inside a
    block only its row and column draws: GPT-2's 6.4M-entry wte/lm_head block 0.8 MB); the
    table h (int64) and the signs (in the input's dtype) on each device used by `__call__`,
    12 bytes per input coordinate for float32 (GPT-2, d = 6.8M: 82 MB), plus a signed copy of at
    most CHUNK_BYTES of the input at a time. Time: one pass over the input, d multiplications and
    d additions per row. Deterministic: each output is the sum of its inputs in increasing order of
    i (CPU: ``index_add_``; other devices: ``index_put_`` with accumulate, which sorts stably), so a row's
    sketch does not depend on the other rows of the batch, and the same input gives the same
    sketch from run to run.

    Identity. With dim >= d the map is the identity (`is_identity`, `dim` = d): nothing is drawn and
    __call__ returns its input, so balancing on it is exact CD-GraB bit for bit. Also
    `GradientSketch.identity(d)`.

    Tensor-sketched blocks. `blocks`: (offset, rows, cols) triples, each a (rows, cols) matrix stored
    row-major at coordinates offset ... offset + rows * cols - 1 (a layer's weight). Inside a block the
    hash and sign are not drawn per coordinate but per row and per column (TensorSketch, Pham & Pagh
    2013): coordinate (i, j) goes to h1(i) + h2(j) mod D with sign s1(i) s2(j), h1 (rows,), h2 (cols,)
    uniform on 0..D-1, s1, s2 uniform +-1, all independent (and drawn after the plain tables, from the
    same generator). The map is still a CountSketch-shaped matrix (one +-1 per column), so `__call__` is
    unchanged; but the sketch of a rank-one block u v^T is the circular convolution of the CountSketches
    C1 u (rows -> D) and C2 v (cols -> D), so a layer's per-unit sketch sum_t P(u_t v_t^T) comes from its
    inputs and output gradients without forming the matrix (`add_outer`, `add_rows`; docs/sketching.md).
    Inner products stay unbiased; the variance gains terms from coordinates that share a row or a column
    (docs/sketching.md gives the formula; tests/test_sketch_records.py checks it).

    Args:
        d: the length of the vectors the map takes (the gradients' length).
        dim: D, the length of their sketches; ``dim >= d`` gives the identity map.
        seed: the seed of the map's draws: the same (d, dim, seed, blocks) give the same map everywhere.
        blocks: (offset, rows, cols) triples of ints, disjoint: the (rows, cols) matrices stored row-major at
            coordinates ``offset .. offset + rows * cols - 1`` that are tensor-sketched (above).

    Raises:
        TypeError: d, dim or seed that is not an integer, or a block that is not an (offset, rows, cols) triple
            of ints.
        ValueError: d or dim below 1, or a block that overlaps another or leaves the d coordinates.
    """

    def __init__(self, d: int, dim: int, seed: int = 0, blocks: Iterable[tuple[int, int, int]] = ()) -> None:
        d, dim = check_int("GradientSketch", "d", d), check_int("GradientSketch", "dim", dim)
        seed = check_seed("GradientSketch", seed)
        if d < 1 or dim < 1:
            raise ValueError(f"GradientSketch: need d >= 1 and dim >= 1, got d={d}, dim={dim}")
        self.d, self.seed = d, seed
        self.is_identity = dim >= d
        self.dim = d if self.is_identity else dim
        # (device, dtype) -> (buckets (d,) int64, signs (d,) dtype)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self.blocks: list[TensorBlock] = []  # TensorBlock per tensor-sketched matrix, in increasing offset
        self.outside: torch.Tensor | None = None  # with blocks: the (d_rest,) coordinates outside them, increasing
        if not self.is_identity:
            sorted_blocks, end = sorted(blocks), 0
            for block in sorted_blocks:
                if not (isinstance(block, (tuple, list)) and len(block) == 3 and all(
                        isinstance(v, int) and not isinstance(v, bool) for v in block)):
                    raise TypeError("GradientSketch: blocks must be (offset, rows, cols) tuples of ints, "
                                    f"got {block!r}")
                offset, rows, cols = block
                if offset < end or offset + rows * cols > d or rows < 1 or cols < 1:
                    raise ValueError(f"GradientSketch: block ({offset}, {rows}, {cols}) overlaps another "
                                     f"or leaves the {d} coordinates")
                end = offset + rows * cols
            # kept compact: the coordinates outside the blocks (5 bytes each, and their int64 index when
            # there are blocks), the blocks as their row and column draws; `tables` rebuilds the whole.
            # The d bucket draws, then the d sign draws, then each block's: drawn DRAW_CHUNK at a time,
            # as int32 / int8, keeping only the coordinates outside the blocks (the same numbers as one
            # int64 draw of d: a GPT-2's 124M coordinates would need 2 GB at once)
            generator = torch.Generator().manual_seed(seed + SEED_OFFSET)
            self.outside = _outside(d, sorted_blocks) if sorted_blocks else None  # (d_rest,) int64, increasing
            buckets = _draw_kept(generator, dim, d, torch.int32, self.outside)
            signs = _draw_kept(generator, 2, d, torch.int8, self.outside).mul_(2).sub_(1)
            self.blocks = [TensorBlock(offset, rows, cols, dim, generator) for offset, rows, cols in sorted_blocks]
            self._outside_tables = (buckets, signs)

    @property
    def family(self) -> str:
        """The kind of map, ``"CountSketch"`` or ``"CountSketch with N TensorSketch block(s)"``."""
        if not self.blocks:
            return "CountSketch"
        return f"CountSketch with {len(self.blocks)} TensorSketch block(s)"

    def block_at(self, offset: int) -> "TensorBlock | None":
        """The tensor-sketched block that starts at a coordinate.

        Args:
            offset: the block's first coordinate.

        Returns:
            The block's `TensorBlock`, or None when no block starts there.
        """
        return next((block for block in self.blocks if block.offset == offset), None)

    @classmethod
    def identity(cls, d: int) -> "GradientSketch":
        """The identity map of R^d (exact balancing).

        Args:
            d: the length of the vectors.

        Returns:
            A `GradientSketch` whose ``is_identity`` is True and whose ``dim`` is d.
        """
        return cls(d, d)

    def __repr__(self) -> str:
        kind = "identity" if self.is_identity else f"{self.family}, seed {self.seed}"
        return f"GradientSketch(d={self.d}, dim={self.dim}: {kind})"

    def tables(self, device: str | torch.device | None = None,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The map's hash and sign of every coordinate, moved to a device once and kept.

        Args:
            device: where the tables go (None: the CPU).
            dtype: the signs' dtype (the input's).

        Returns:
            (buckets, signs): buckets (d,) int64, h_i; signs (d,) of +-1 in ``dtype``, s_i.

        Raises:
            ValueError: the identity map, which has no tables.
        """
        if self.is_identity:
            raise ValueError("GradientSketch: the identity map has no tables")
        device = torch.device(device or "cpu")
        key = (device, dtype)
        if key not in self._tables:
            self._tables[key] = self.tables_at(None, device, dtype)
        return self._tables[key]

    def tables_at(self, index: torch.Tensor | None, device: str | torch.device | None = None,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The hash and sign of some coordinates, not kept (the records path needs only the coordinates
        outside the blocks).

        Args:
            index: (m,) LongTensor of coordinates, or None: all d.
            device: where the tables go (None: the CPU).
            dtype: the signs' dtype.

        Returns:
            (buckets, signs): buckets (m,) int64; signs (m,) of +-1 in ``dtype``.
        """
        if index is not None and self.outside is not None and torch.equal(index, self.outside):
            buckets, signs = self._outside_tables  # the records path's coordinates: nothing to rebuild
        else:
            buckets, signs = self._drawn()
            if index is not None:
                buckets, signs = buckets[index], signs[index]
        return buckets.to(device=device, dtype=torch.int64), signs.to(device=device, dtype=dtype)

    def _drawn(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every coordinate's (bucket, sign), (d,) each, rebuilt from the outside tables and the blocks."""
        if self.outside is None:
            return self._outside_tables
        buckets, signs = torch.empty(self.d, dtype=torch.int32), torch.empty(self.d, dtype=torch.int8)
        buckets[self.outside], signs[self.outside] = self._outside_tables
        for block in self.blocks:
            end = block.offset + block.rows * block.cols
            buckets[block.offset:end], signs[block.offset:end] = block.hash_and_sign()
        return buckets, signs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sketch vectors.

        Args:
            x: (..., d) vectors (not differentiated through).

        Returns:
            (..., dim) their sketches, in x's dtype and on x's device; x itself for the identity.

        Raises:
            ValueError: x's last dimension is not d.
        """
        if x.shape[-1:] != (self.d,):
            raise ValueError(f"GradientSketch: input must have shape (..., {self.d}), got {tuple(x.shape)}")
        if self.is_identity:
            return x
        rows = x.detach().reshape(-1, self.d)
        buckets, signs = self.tables(x.device, x.dtype)
        out = self._sketch_rows(rows, buckets, signs, in_order=x.device.type == "cpu")
        return out.reshape(*x.shape[:-1], self.dim)

    def _sketch_rows(self, rows: torch.Tensor, buckets: torch.Tensor, signs: torch.Tensor,
                     in_order: bool) -> torch.Tensor:
        """rows (N, d) -> (N, dim), a signed copy of CHUNK_BYTES of the rows at a time. in_order (the CPU):
        index_add_, which adds in increasing i; else index_put_ with accumulate, which sorts stably first
        (CUDA's index_add_ adds in any order: atomics). Either path runs on any device."""
        # the index_put_ path accumulates into rows of a (dim, N) tensor: the transposed output
        out = rows.new_zeros(rows.shape[0], self.dim) if in_order else rows.new_zeros(self.dim, rows.shape[0])
        width = max(1, CHUNK_BYTES // max(1, rows.shape[0] * rows.element_size()))
        for start in range(0, self.d, width):
            cols = slice(start, start + width)
            signed = rows[:, cols] * signs[cols]
            if in_order:
                out.index_add_(1, buckets[cols], signed)
            else:
                out.index_put_((buckets[cols],), signed.T.contiguous(), accumulate=True)
        return out if in_order else out.T.contiguous()

    def matrix(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The map as a dense matrix (for tests and small d only).

        Args:
            dtype: the matrix's dtype.

        Returns:
            (dim, d): one +-1 per column (the identity matrix for the identity map).
        """
        if self.is_identity:
            return torch.eye(self.d, dtype=dtype)
        buckets, signs = self._drawn()
        P = torch.zeros(self.dim, self.d, dtype=dtype)
        P[buckets.long(), torch.arange(self.d)] = signs.to(dtype)
        return P



DRAW_CHUNK = 2**22  # coordinates per draw while building a map's tables


def _outside(d: int, blocks: list[tuple[int, int, int]]) -> torch.Tensor:
    """(d_rest,) int64: the coordinates of 0..d-1 outside the (offset, rows, cols) blocks (sorted, disjoint)."""
    gaps, start = [], 0
    for offset, rows, cols in blocks:
        gaps.append(torch.arange(start, offset))
        start = offset + rows * cols
    gaps.append(torch.arange(start, d))
    return torch.cat(gaps)


def _draw_kept(generator: torch.Generator, high: int, d: int, dtype: torch.dtype,
               kept: torch.Tensor | None) -> torch.Tensor:
    """d draws of randint(0, high) from `generator` (as one draw of d would give them), DRAW_CHUNK at a
    time, of which only the coordinates `kept` (increasing; None: all) are returned, in `dtype`."""
    if kept is None:
        return torch.cat([torch.randint(0, high, (min(DRAW_CHUNK, d - start),), generator=generator, dtype=dtype)
                          for start in range(0, d, DRAW_CHUNK)])
    pieces, first = [], 0
    for start in range(0, d, DRAW_CHUNK):
        stop = min(start + DRAW_CHUNK, d)
        drawn = torch.randint(0, high, (stop - start,), generator=generator, dtype=dtype)
        last = first + int(torch.searchsorted(kept[first:], stop))
        pieces.append(drawn[kept[first:last] - start])
        first = last
    return torch.cat(pieces)


class TensorBlock:
    """One tensor-sketched (rows, cols) block of a GradientSketch: h1 (rows,), s1 (rows,) for the rows,
    h2 (cols,), s2 (cols,) for the columns; coordinate (i, j) -> bucket (h1[i] + h2[j]) mod D, sign
    s1[i] s2[j]. The per-unit sketches of sums of outer products are added with `add_outer` (dense
    factors) and `add_rows` (one-hot rows: an embedding lookup)."""

    def __init__(self, offset: int, rows: int, cols: int, dim: int, generator: torch.Generator) -> None:
        self.offset, self.rows, self.cols, self.dim = offset, rows, cols, dim
        self.h1 = torch.randint(0, dim, (rows,), generator=generator)
        self.h2 = torch.randint(0, dim, (cols,), generator=generator)
        self.s1 = torch.randint(0, 2, (rows,), generator=generator).mul_(2).sub_(1)
        self.s2 = torch.randint(0, 2, (cols,), generator=generator).mul_(2).sub_(1)
        # (device, dtype) -> (signed buckets of the rows, of the columns, h1, h2, s1, s2) there (_on)
        self._moved: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}

    def hash_and_sign(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's (rows * cols,) buckets and signs, row-major."""
        return (((self.h1[:, None] + self.h2[None, :]) % self.dim).reshape(-1),
                (self.s1[:, None] * self.s2[None, :]).reshape(-1))

    def _on(self, device: str | torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(signed buckets of the rows, of the columns, h1, h2, s1, s2) on `device`, the signs in `dtype`."""
        key = (torch.device(device), dtype)
        if key not in self._moved:
            # signed buckets: index 2 h + (s < 0) of a (., 2 D) sum, so that the sign costs no pass over the input
            signed = tuple(2 * h.to(device) + (s.to(device) < 0) for h, s in ((self.h1, self.s1), (self.h2, self.s2)))
            self._moved[key] = signed + (self.h1.to(device), self.h2.to(device),
                                         self.s1.to(device=device, dtype=dtype), self.s2.to(device=device, dtype=dtype))
        return self._moved[key]

    def _countsketch(self, x: torch.Tensor, signed_buckets: torch.Tensor, buckets: torch.Tensor,
                     signs: torch.Tensor) -> torch.Tensor:
        """x (N, n) -> (N, D): sum_i s_i x_i into bucket h_i (index_add adds in increasing i). A narrow x
        (n <= 2 D) is signed first and added into D buckets; a wide one (an LM head's vocabulary) is added
        unsigned into 2 D buckets (2 h + (s < 0)), then the halves subtracted: no signed copy of x."""
        if x.shape[1] <= 2 * self.dim:
            return x.new_zeros(x.shape[0], self.dim).index_add_(1, buckets, x * signs)
        both = x.new_zeros(x.shape[0], 2 * self.dim).index_add_(1, signed_buckets, x)
        return both[:, 0::2] - both[:, 1::2]

    def add_outer(self, left: torch.Tensor, right: torch.Tensor, out: torch.Tensor) -> None:
        """out (U, D) += P(sum_t left[u, t] right[u, t]^T) for each unit u; left (U, T, rows), right (U, T, cols).

        TensorSketch: P(u v^T) = C1 u (*) C2 v, the circular convolution of the rows' and columns'
        CountSketches, so the sum over t is irfft(sum_t rfft(C1 u_t) rfft(C2 v_t)): the (rows, cols)
        matrix is never formed."""
        U, T = left.shape[:2]
        signed1, signed2, h1, h2, s1, s2 = self._on(left.device, left.dtype)
        # the units in groups, so that the (tokens, D) spectra stay within about CHUNK_BYTES
        per_group = max(1, CHUNK_BYTES // max(1, T * self.dim * 2 * left.element_size()))
        for start in range(0, U, per_group):
            units = slice(start, start + per_group)
            n = left[units].shape[0]
            a = torch.fft.rfft(self._countsketch(left[units].reshape(n * T, self.rows), signed1, h1, s1))
            b = torch.fft.rfft(self._countsketch(right[units].reshape(n * T, self.cols), signed2, h2, s2))
            spectrum = (a * b).view(n, T, -1).sum(1)
            out[units] += torch.fft.irfft(spectrum, n=self.dim)

    def add_rows(self, ids: torch.Tensor, right: torch.Tensor, out: torch.Tensor) -> None:
        """out (U, D) += P(sum_t e_{ids[u, t]} right[u, t]^T); ids (U, T) row indices, right (U, T, cols)
        (an embedding's per-unit gradient: right[u, t] scattered into row ids[u, t]). Each term is a
        scatter of the cols values to buckets h1[id] + h2[j] mod D with signs s1[id] s2[j]."""
        _, _, h1, h2, s1, s2 = self._on(right.device, right.dtype)
        U = ids.shape[0]
        buckets = (h1[ids][..., None] + h2) % self.dim          # (U, T, cols)
        values = right * s1[ids][..., None] * s2                  # (U, T, cols)
        out.scatter_add_(1, buckets.reshape(U, -1), values.reshape(U, -1))
