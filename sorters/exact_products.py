r"""Exact inner products of per-example gradients, parameter by parameter, without holding them whole.

Exact CD-GraB (sorters/exact.py) needs, for one step's U units (examples) with gradients g_u and the
running sum S, only
    (a) <S, g_u>          (U,)      the units' products with the sum at the step's start,
    (b) <g_u, g_v>        (U, U)    their Gram matrix,
    (c) S += sum_u w_u g_u          once the signs (the weights w) are known;
(a) and (b) add up over parameters, (c) is done parameter by parameter. Each parameter's per-example
gradient is a sum of CONTRIBUTIONS, one per call of a layer that holds it (a tied weight: one per layer
using it), built from the records of one batched forward and backward (a_t a call's input at token t,
g_t its output's gradient, row u = unit u):

    Linear weight (out, in):    Outer(left=g, right=a)     g_u = sum_t g_ut a_ut^T
    Conv1D weight (in, out):    Outer(left=a, right=g)     g_u = sum_t a_ut g_ut^T   (transformers' Conv1D)
    Embedding weight (V, e):    Rows(ids, g)               row ids_ut of g_u += g_ut; padding_idx rows: 0
    bias (out,):                Formed(sum_t g_ut)
    LayerNorm weight, bias:     Formed(sum_t g_ut * xhat_ut), Formed(sum_t g_ut)

Two ways to get (a) and (b) for a parameter of shape (R, C) (`parameter_products`):
- stream: form the units' gradients of a block of rows, (U, rows, C), by one batched product per
  contribution (the flops of the layer's weight gradient), take G_block S_block and G_block G_block^T,
  drop the block, go on (a vocabulary matrix in blocks of rows, never (U, V, e) at once);
- ghost: never form them. (a) <S, g_u> = sum_t left_ut^T S right_ut; (b) per pair of contributions
  <x_u, y_v> = sum_{t,t'} (left_ut . left_vt')(right_ut . right_vt') for two Outers, and the cross terms
  of a tied matrix: Outer x Rows = sum_{t,t'} left_ut[ids_vt'] (right_ut . values_vt'), Rows x Rows =
  sum_{t,t'} [ids_ut = ids_vt'] (values_ut . values_vt'). Its cost grows with (U T)^2 (R + C) instead of
  U T R C, so it wins where tokens are few against the layer's size (`ghost_pays`).
Both give the same numbers up to rounding; the tests check each rule against gradients formed by
autograd, one example at a time.

(c) is one product per contribution: Outer S += left^T diag(w) right over the tokens of the units of
nonzero weight, Rows an index_add of their weighted rows, Formed a weighted sum.

Which contributions a layer makes is the library's one table of layer rules (sorters/layer_rules.py); here
they arrive through a ContributionSink, which keeps them factored.
"""

from typing import cast

import torch

from sorters.layer_rules import Sink

STREAM_BLOCK_BYTES = 8 * 2**20  # the (U, rows, C) block streaming holds at once: small enough to stay in cache


class Outer:
    """sum_t left[u, t] right[u, t]^T for each unit u: left (U, T, R), right (U, T, C), an (R, C) matrix each."""

    def __init__(self, left: torch.Tensor, right: torch.Tensor) -> None:
        self.left, self.right = left, right
        self.units, self.tokens = left.shape[0], left.shape[1]

    def add_rows(self, out: torch.Tensor, r0: int, r1: int) -> None:
        """out (U, r1 - r0, C) += rows r0:r1 of every unit's matrix."""
        out.baddbmm_(self.left[:, :, r0:r1].transpose(1, 2), self.right)

    def dot(self, S: torch.Tensor) -> torch.Tensor:
        """(U,) <S, x_u> for S (R, C): sum_t left_ut^T S right_ut."""
        return ((self.right @ S.T) * self.left).sum((1, 2))

    def add_to(self, S: torch.Tensor, w: torch.Tensor) -> None:
        """S (R, C) += sum_u w_u x_u over the units of nonzero weight, as ONE product over their tokens (a long
        inner dimension runs faster than one product per unit): the smaller of the two factors of those units
        is copied times the weights (k T min(R, C) numbers), the other is read as it is."""
        kept = _nonzero_units(w, self.left, self.right)
        if kept is None:
            return
        weights, (left, right) = kept
        if left.shape[2] <= right.shape[2]:
            left = left * weights[:, None, None]
        else:
            right = right * weights[:, None, None]
        S.addmm_(left.reshape(-1, left.shape[2]).T, right.reshape(-1, right.shape[2]))

    def add_sum(self, S: torch.Tensor) -> None:
        """S (R, C) += sum_u x_u: one product over every unit's tokens (a layer's weight gradient)."""
        S.addmm_(self.left.reshape(-1, self.left.shape[2]).T, self.right.reshape(-1, self.right.shape[2]))

    def select(self, units: torch.Tensor) -> "Outer":
        """The units `units` ((k,) LongTensor), in this order: a copy of their records."""
        return Outer(self.left[units], self.right[units])

    def units_slice(self, start: int, stop: int) -> "Outer":
        """Units start..stop-1, views of the records."""
        return Outer(self.left[start:stop], self.right[start:stop])

    def scaled(self, factors: torch.Tensor) -> "Outer":
        return Outer(self.left * factors[:, None, None], self.right)

    def rows(self, r0: int, r1: int) -> "Outer":
        """The contribution to rows r0..r1-1 of the matrix only, (r1 - r0, C) per unit: the rows are left's
        columns (a Linear's output gradient, a Conv1D's input), so a slice of left, views of the records
        (sorters/fsdp.py: a process owning those rows of a sharded parameter)."""
        return Outer(self.left[:, :, r0:r1], self.right)


class Rows:
    """Embedding rows: values[u, t] (C,) into row ids[u, t] of unit u's (R, C) matrix; ids (U, T)."""

    def __init__(self, ids: torch.Tensor, values: torch.Tensor, num_rows: int) -> None:
        self.ids, self.values, self.num_rows = ids, values, num_rows
        self.units, self.tokens = ids.shape

    def add_rows(self, out: torch.Tensor, r0: int, r1: int) -> None:
        inside = (self.ids >= r0) & (self.ids < r1)
        units, tokens = inside.nonzero(as_tuple=True)
        out.index_put_((units, self.ids[units, tokens] - r0), self.values[units, tokens], accumulate=True)

    def dot(self, S: torch.Tensor) -> torch.Tensor:
        return (S[self.ids] * self.values).sum((1, 2))

    def add_to(self, S: torch.Tensor, w: torch.Tensor) -> None:
        """S (R, C) += sum_u w_u x_u over the units of nonzero weight: one index_add of their weighted values."""
        kept = _nonzero_units(w, self.ids, self.values)
        if kept is None:
            return
        weights, (ids, values) = kept
        S.index_add_(0, ids.reshape(-1), (values * weights[:, None, None]).reshape(-1, values.shape[2]))

    def add_sum(self, S: torch.Tensor) -> None:
        S.index_add_(0, self.ids.reshape(-1), self.values.reshape(-1, self.values.shape[2]))

    def select(self, units: torch.Tensor) -> "Rows":
        return Rows(self.ids[units], self.values[units], self.num_rows)

    def units_slice(self, start: int, stop: int) -> "Rows":
        return Rows(self.ids[start:stop], self.values[start:stop], self.num_rows)

    def scaled(self, factors: torch.Tensor) -> "Rows":
        return Rows(self.ids, self.values * factors[:, None, None], self.num_rows)

    def rows(self, r0: int, r1: int) -> "Rows":
        """The contribution to rows r0..r1-1 only (r1 > r0): the tokens whose id falls there, renumbered from
        0; every other token keeps its place with id 0 and zero values (it adds nothing to any product)."""
        inside = (self.ids >= r0) & (self.ids < r1)
        ids = torch.where(inside, self.ids - r0, torch.zeros_like(self.ids))
        return Rows(ids, self.values * inside.unsqueeze(-1).to(self.values.dtype), r1 - r0)


class Formed:
    """Per-unit gradients already formed: values (U, R, C) (a vector parameter: (U, n, 1))."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values
        self.units, self.tokens = values.shape[0], 1

    def add_rows(self, out: torch.Tensor, r0: int, r1: int) -> None:
        out.add_(self.values[:, r0:r1])

    def dot(self, S: torch.Tensor) -> torch.Tensor:
        return self.values.reshape(self.units, -1) @ S.reshape(-1)

    def add_to(self, S: torch.Tensor, w: torch.Tensor) -> None:
        S.add_(torch.tensordot(w, self.values, dims=1))

    def add_sum(self, S: torch.Tensor) -> None:
        S.add_(self.values.sum(0))

    def select(self, units: torch.Tensor) -> "Formed":
        return Formed(self.values[units])

    def units_slice(self, start: int, stop: int) -> "Formed":
        return Formed(self.values[start:stop])

    def scaled(self, factors: torch.Tensor) -> "Formed":
        return Formed(self.values * factors[:, None, None])

    def rows(self, r0: int, r1: int) -> "Formed":
        """The units' gradients of rows r0..r1-1 only, (U, r1 - r0, C) views (a bias: its entries r0..r1-1)."""
        return Formed(self.values[:, r0:r1])


def _nonzero_units(w: torch.Tensor, *records: torch.Tensor
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    """The units of nonzero weight in w (U,): (their weights (k,), each of the records' (U, ...) rows of them:
    the records themselves when every unit is kept), or None when there are none."""
    kept = w.ne(0).nonzero().reshape(-1)
    if len(kept) == 0:
        return None
    if len(kept) == len(w):
        return w, records
    return w[kept], tuple(x[kept] for x in records)


# one layer call's contribution to a parameter's per-unit gradients, factored (Outer, Rows) or formed
Contribution = Outer | Rows | Formed
# one parameter's contributions in recording order: (the contribution's first unit, the contribution)
Pieces = list[tuple[int, Contribution]]
# the products of U units, (a (U,), G (U, U)), or of r pairs' differences, (a (r,), G (r, r), norms (U,))
_Products = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# parameter_products' result: the products, then how they were taken ("stream" or "ghost") and the gradient
# sum it was asked for (or None)
_ParameterProducts = (tuple[torch.Tensor, torch.Tensor, str, torch.Tensor | None]
                     | tuple[torch.Tensor, torch.Tensor, torch.Tensor, str, torch.Tensor | None])


# ------------------------------------------------------------------------------------ from the rules' table

class ContributionSink(Sink):
    """The sink the table of layer rules (sorters/layer_rules.py) writes into for exact products: it keeps
    each call's contribution to a parameter FACTORED instead of forming it, pieces {id(p): [(0, contribution)]}
    (the 0: the contribution's first unit, as parameter_products takes them).

    add_outer(p, left, right) -> Outer(left, right); add_rows(p, ids, g) -> Rows(ids, g, rows of p);
    add(p, value (U, *p.shape)) -> Formed (U, R, C) (a bias or LayerNorm vector: (U, n, 1)).
    selected: the ids of the parameters wanted (the others are skipped by the rules)."""

    def __init__(self, pieces: dict[int, Pieces], selected: set[int]) -> None:
        self.pieces, self.selected = pieces, selected

    def wants(self, p: torch.Tensor) -> bool:
        return id(p) in self.selected

    def _keep(self, p: torch.Tensor, contribution: Contribution) -> None:
        self.pieces.setdefault(id(p), []).append((0, contribution))

    def add(self, p: torch.Tensor, value: torch.Tensor) -> None:
        self._keep(p, Formed(value.reshape(value.shape[0], *matrix_shape(p))))

    def add_outer(self, p: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
        self._keep(p, Outer(left, right))

    def add_rows(self, p: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> None:
        self._keep(p, Rows(ids, g, p.shape[0]))


def matrix_shape(p: torch.Tensor) -> tuple[int, int]:
    """(R, C): the rows and columns a parameter's gradient is handled as (a vector: (n, 1))."""
    return (p.shape[0], p.numel() // p.shape[0]) if p.dim() >= 1 else (1, 1)


# ---------------------------------------------------------------------------------------------- products

def _ghost_possible(pieces: Pieces) -> bool:
    """Ghost products need every contribution factored (Outer or Rows), or every one Formed."""
    kinds = {type(x) for _, x in pieces}
    return Formed not in kinds or kinds == {Formed}


def stream_cost(pieces: Pieces, U: int, R: int, C: int, pairs: int | None = None) -> float:
    """Forming the units' gradients block by block: each contribution's batched product (Outer: 2 U T R C
    flops; Rows: writing U T C), zeroing and reading the (U, R, C) blocks, then (a) and (b) of the U units
    (2 U (U + 1) R C), or with `pairs` (r of them) the r differences' (2 r (r + 1) R C) and the U norms."""
    form = sum(2 * x.units * x.tokens * R * C if isinstance(x, Outer) else x.units * x.tokens * C
               for _, x in pieces)
    products = (2 * U + 2) * U if pairs is None else (2 * pairs + 3) * pairs + 2 * U
    return form + (products + 2 * U) * R * C


def ghost_cost(pieces: Pieces, R: int, C: int, grad_units: int = 0) -> float:
    """The ghost formulas: (a) 2 U T R C per Outer, (b) 2 (U T)(U' T') (R + C) per pair of contributions; with
    grad_units, the sum of those units' gradients too (`summed`: 2 U T R C per Outer; streaming has it from its
    blocks)."""
    dot = sum(2 * x.units * x.tokens * R * C if isinstance(x, Outer) else 2 * x.units * x.tokens * C
              for _, x in pieces)
    gram = sum(2 * (x.units * x.tokens) * (y.units * y.tokens) * (R + C)
               for i, (_, x) in enumerate(pieces) for _, y in pieces[i:])
    grad = sum(2 * x.units * x.tokens * R * C if isinstance(x, Outer) else x.units * x.tokens * C
               for first, x in pieces if first < grad_units)
    return dot + gram + grad


def ghost_pays(pieces: Pieces, U: int, R: int, C: int, grad_units: int = 0, pairs: int | None = None) -> bool:
    """Whether the ghost formulas are cheaper than streaming: GHOST_MARGIN * ghost flops < stream flops, both
    for what the call asks (`pairs` differences, the sum of `grad_units` units). Streaming also writes and reads
    the (U, R, C) blocks, which the flop count undercounts, so ghost wins up to about twice streaming's flops
    (bench/exact_products.py times both; docs/exact-cdgrab.md)."""
    if not _ghost_possible(pieces) or all(isinstance(x, Formed) for _, x in pieces):
        return False
    return GHOST_MARGIN * ghost_cost(pieces, R, C, grad_units) < stream_cost(pieces, U, R, C, pairs)


GHOST_MARGIN = 0.5


def stream_products(pieces: Pieces, S: torch.Tensor, U: int, grad: torch.Tensor | None = None, grad_units: int = 0,
                    pairs: "Pairs | None" = None) -> _Products:
    """(a, G) in float64 by forming the units' gradients STREAM_BLOCK_BYTES of rows at a time: of the units,
    (a (U,), G (U, U)); with `pairs`, of the pairs' differences (a (r,), G (r, r)) and the units' squared
    norms (U,) as a third result (the Gram of r differences costs r^2 against U^2). pieces: [(first unit,
    contribution)]; S (R, C). grad: None, or an (R, C) tensor that receives the sum of units 0..grad_units-1's
    blocks (the backward's weight gradient, or every unit's sum, from the blocks already formed)."""
    R, C = S.shape
    rows = max(1, min(R, STREAM_BLOCK_BYTES // max(1, U * C * S.element_size())))
    r = U if pairs is None else len(pairs.firsts)
    a = torch.zeros(r, dtype=torch.float64, device=S.device)
    G = torch.zeros(r, r, dtype=torch.float64, device=S.device)
    norms = torch.zeros(U, dtype=torch.float64, device=S.device) if pairs is not None else None
    block = torch.empty(U, rows, C, dtype=S.dtype, device=S.device)
    leads, unwritten = _block_leads(pieces, U)
    for r0 in range(0, R, rows):
        r1 = min(R, r0 + rows)
        out = block[:, :r1 - r0]
        for first, stop in unwritten:
            out[first:stop].zero_()
        for i, (first, x) in enumerate(pieces):
            if i in leads:
                lead = cast(Outer, x)  # _block_leads picks Outers only
                torch.bmm(lead.left[:, :, r0:r1].transpose(1, 2), lead.right, out=out[first:first + x.units])
            else:
                x.add_rows(out[first:first + x.units], r0, r1)
        flat = out.reshape(U, -1)
        if grad is not None:
            torch.sum(out[:grad_units], 0, out=grad[r0:r1])
        if pairs is not None:
            norms += torch.linalg.vector_norm(flat, dim=1).double().square()  # of the records: scaled at the end
            flat = pairs.differences(flat)
        a += (flat @ S[r0:r1].reshape(-1)).double()
        G += (flat @ flat.T).double()
    if pairs is None or norms is None:  # (norms is None exactly when pairs is)
        return a, G
    return (*pairs.rescale(a, G), norms * pairs.inverse_scale.to(norms.device, torch.float64) ** 2)


def _block_leads(pieces: Pieces, U: int) -> tuple[set[int], list[tuple[int, int]]]:
    """(leads, unwritten): the contributions that WRITE their units' rows of a streamed block (bmm into it,
    instead of adding to zeros: a pass less), the first Outer of each range of units that no earlier
    contribution touches; and the (start, stop) ranges of units no lead writes, zeroed first."""
    leads: set[int] = set()
    touched, written = [False] * U, [False] * U
    for i, (first, x) in enumerate(pieces):
        span = range(first, first + x.units)
        if isinstance(x, Outer) and not any(touched[u] for u in span):
            leads.add(i)
            for u in span:
                written[u] = True
        for u in span:
            touched[u] = True
    unwritten: list[tuple[int, int]] = []
    start: int | None = None
    for u, done in enumerate(written + [True]):  # a sentinel closes the last range
        if not done and start is None:
            start = u
        elif done and start is not None:
            unwritten.append((start, u))
            start = None
    return leads, unwritten


class Pairs:
    """r pairs of units (firsts[i], seconds[i]) and each unit's factor (the inverse of its records' scale):
    the difference i is firsts[i]'s gradient less seconds[i]'s."""

    def __init__(self, firsts: list[int], seconds: list[int], inverse_scale: torch.Tensor) -> None:
        device = inverse_scale.device
        self.firsts, self.seconds, self.inverse_scale = firsts, seconds, inverse_scale
        self.first_index = torch.tensor(firsts, dtype=torch.long, device=device)
        self.second_index = torch.tensor(seconds, dtype=torch.long, device=device)
        self.first_factor = inverse_scale[self.first_index][:, None]
        self.second_factor = inverse_scale[self.second_index][:, None]
        # one factor for every unit of the pairs (a loop's batch mean): the records' differences, scaled once
        # in the products; consecutive firsts and seconds (k = 1: the pending units after the step's) are slices
        paired = inverse_scale[torch.cat([self.first_index, self.second_index])]
        self.common = float(paired[0]) if len(firsts) and bool((paired == paired[0]).all()) else None
        self.slices = [slice(units[0], units[0] + len(units)) if units == list(range(units[0], units[0] + len(units)))
                       else None for units in (firsts, seconds)] if firsts else [None, None]

    def differences(self, flat: torch.Tensor) -> torch.Tensor:
        """flat (U, n) records of the units -> (r, n) the pairs' differences: of their gradients, or with a
        common factor (`common`) of their records (the products are then multiplied by it, `rescale`)."""
        if self.common is not None:
            first, second = (flat[taken] if taken is not None else flat.index_select(0, index)
                             for taken, index in zip(self.slices, (self.first_index, self.second_index)))
            return torch.sub(first, second)
        first = flat[self.first_index].mul_(self.first_factor.to(flat.dtype))
        return first.sub_(flat[self.second_index].mul_(self.second_factor.to(flat.dtype)))

    def rescale(self, a: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The products of `differences` (float64) as products of the gradients' differences."""
        if self.common is None:
            return a, G
        return a * self.common, G * (self.common * self.common)

    def combine(self, a: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The units' (a (U,), G (U, U)) of gradients -> the differences' (a (r,), G (r, r)), the units' norms (U,)."""
        f, s = self.first_index.to(a.device), self.second_index.to(a.device)
        diff_G = G[f][:, f] - G[f][:, s] - G[s][:, f] + G[s][:, s]
        return a[f] - a[s], diff_G, G.diagonal().clone()


def summed(pieces: Pieces, R: int, C: int, units: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(R, C) sum over units 0..units-1 of their gradients (contributions starting at a unit >= units are
    another step's: left out), one product per contribution."""
    out = torch.zeros(R, C, dtype=dtype, device=device)
    for first, x in pieces:
        if first < units:
            x.add_sum(out)
    return out


def ghost_products(pieces: Pieces, S: torch.Tensor, U: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a (U,), G (U, U)) in float64 from the contributions' factors, never forming a unit's gradient."""
    a = torch.zeros(U, dtype=torch.float64, device=S.device)
    G = torch.zeros(U, U, dtype=torch.float64, device=S.device)
    for i, (fx, x) in enumerate(pieces):
        a[fx:fx + x.units] += x.dot(S).double()
        for fy, y in pieces[i:]:
            block = _ghost_gram(x, y).double()
            G[fx:fx + x.units, fy:fy + y.units] += block
            if y is not x:
                G[fy:fy + y.units, fx:fx + x.units] += block.T
    return a, G


def _ghost_gram(x: Contribution, y: Contribution) -> torch.Tensor:
    """(Ux, Uy) <x_u, y_v> for two factored contributions to one parameter (or two formed ones: the pieces
    pass _ghost_possible, so a Formed x comes with a Formed y, and a factored x with a factored y)."""
    if isinstance(x, Rows) and isinstance(y, Outer):
        return _ghost_gram(y, x).T
    if isinstance(x, Formed):
        return x.values.reshape(x.units, -1) @ cast(Formed, y).values.reshape(y.units, -1).T
    if isinstance(x, Outer):
        left = x.left.reshape(-1, x.left.shape[2])
        right = x.right.reshape(-1, x.right.shape[2])
        if isinstance(y, Outer):
            tokens = (left @ y.left.reshape(-1, y.left.shape[2]).T) * (right @ y.right.reshape(-1, y.right.shape[2]).T)
        else:  # Outer x Rows (a tied matrix): left_ut[ids_vt'] (right_ut . values_vt')
            rows = cast(Rows, y)
            tokens = left[:, rows.ids.reshape(-1)] * (right @ rows.values.reshape(-1, rows.values.shape[2]).T)
    else:  # Rows x Rows: [ids_ut = ids_vt'] (values_ut . values_vt')
        y = cast(Rows, y)
        same = x.ids.reshape(-1, 1) == y.ids.reshape(1, -1)
        tokens = same * (x.values.reshape(-1, x.values.shape[2]) @ y.values.reshape(-1, y.values.shape[2]).T)
    return tokens.view(x.units, x.tokens, y.units, y.tokens).sum((1, 3))


def parameter_products(pieces: Pieces, S: torch.Tensor, U: int, how: str | None = None, grad_units: int = 0,
                       pairs: "Pairs | None" = None) -> _ParameterProducts:
    """(a, G, how, grad): one parameter's products for U units, pieces [(first unit, contribution)], S (R, C):
    (a (U,), G (U, U)) of the records; with `pairs`, (a, G, norms, how, grad): (a (r,), G (r, r)) of the pairs'
    gradient differences and norms (U,) the units' squared gradient norms, the records divided by their
    scale (pairs.inverse_scale (U,)). how: "stream", "ghost", or None (the cheaper by `ghost_pays`). grad_units > 0:
    grad (R, C) is also the sum of the records of units 0..grad_units-1 (streaming: from its blocks), else None."""
    if how is None:
        R, C = S.shape
        how = "ghost" if ghost_pays(pieces, U, R, C, grad_units, None if pairs is None else len(pairs.firsts)) \
            else "stream"
    if how == "ghost" and not _ghost_possible(pieces):
        how = "stream"
    grad = None
    products: _Products
    if how == "stream":
        grad = torch.empty(S.shape, dtype=S.dtype, device=S.device) if grad_units else None
        products = stream_products(pieces, S, U, grad, grad_units, pairs)
    else:
        products = ghost_products(pieces, S, U)
        if pairs is not None:
            factor = pairs.inverse_scale.to(products[0].device, torch.float64)
            products = pairs.combine(products[0] * factor, products[1] * factor[:, None] * factor[None, :])
        if grad_units:
            R, C = S.shape
            grad = summed(pieces, R, C, grad_units, S.dtype, S.device)
    return (*products, how, grad)


def add_weighted(pieces: Pieces, S: torch.Tensor, w: torch.Tensor) -> None:
    """S (R, C) += sum_u w_u g_u over the units of nonzero weight (w (U,) in S's dtype): one product per
    contribution over the kept units' tokens (Outer and Rows leave the others out), Formed multiplies them by 0."""
    for first, x in pieces:
        weights = w[first:first + x.units]
        if bool(weights.ne(0).any()):
            x.add_to(S, weights)
