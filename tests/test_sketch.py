"""Sketched balancing (--sketch-dim, sorters.GradientSketch): the map is the CountSketch its docstring
states, with the stated inner-product mean and variance; the identity is exact CD-GraB bit for bit;
sketched runs give permutations, agree between one process and torchrun, and gather n * k * D floats."""
import json
import math

import pytest
import torch

from engine.comm import GradientExchange, LocalCommunicator
from engine.reducers import make_reducer
from sorters import CDGraBSampler, GradientSketch, PerExampleGrads
from tests.helpers import (check_ok, check_run_files, check_torchrun_agrees, error_lines, needs_data, read_metrics,
                           run_script)

# ------------------------------------------------------------------------------------------- the map


def test_the_map_is_a_linear_countsketch():
    """P (dim, d) has exactly one +-1 per column, and the sketch of any batch is x P^T, row by row."""
    d, dim = 300, 17
    sketch = GradientSketch(d, dim, seed=4)
    x = torch.randn(2, 3, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = sketch(x)
    assert y.shape == (2, 3, dim) and y.dtype == torch.float64
    P = torch.zeros(dim, d, dtype=torch.float64)
    for i in range(d):  # the map read off the basis vectors, one at a time
        e = torch.zeros(d, dtype=torch.float64)
        e[i] = 1
        P[:, i] = sketch(e)
    assert torch.equal(P.abs().sum(0), torch.ones(d)) and set(P.unique().tolist()) == {-1.0, 0.0, 1.0}
    assert torch.equal(P, sketch.matrix())
    assert torch.allclose(y, x @ P.T, rtol=0, atol=1e-12)
    # linear: a combination of inputs maps to the combination of sketches
    a, b = x[0, 0], x[1, 2]
    assert torch.allclose(sketch(2.5 * a - 3 * b), 2.5 * sketch(a) - 3 * sketch(b), atol=1e-12)
    # float32 in, float32 out; a row's sketch does not depend on the other rows of its batch
    x32 = x.float().reshape(6, d)
    assert torch.equal(sketch(x32)[4], sketch(x32[4:5])[0])
    assert len(set(P.argmax(0).tolist())) > dim // 2  # the buckets are spread, not all in one


def countsketch_variance(x, y, dim):
    """The oracle, from the definition: <Px, Py> - <x, y> = sum_{i != j} [h_i = h_j] s_i s_j x_i y_j. In its
    square only the products of the (i, j) and (j, i) terms have a non-zero mean (independent signs), and
    [h_i = h_j] has mean 1/dim."""
    x, y = x.double(), y.double()
    cross = torch.outer(x, y)  # x_i y_j
    off_diagonal = ~torch.eye(len(x), dtype=torch.bool)
    # sum_{i != j} x_i^2 y_j^2 + x_i y_i x_j y_j (the (i, j) and (j, i) terms of the square)
    total = (cross.square() + cross * cross.T)[off_diagonal].sum()
    return float(total / dim)


@pytest.mark.parametrize("d,dim", [(128, 32), (40, 10)])
def test_inner_products_are_unbiased_with_the_documented_variance(d, dim):
    """Over 6000 independent maps (seeds), <Px, Py> has mean <x, y> (within 4 standard errors) and variance
    within 10 % of the docstring's formula (the standard error of a sample variance here is about 2 %)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(d, generator=g, dtype=torch.float64) + 0.5  # non-zero means: a sign-free map is biased
    y = 0.6 * x + torch.randn(d, generator=g, dtype=torch.float64)  # correlated: <x, y>^2 matters
    x[0], y[0] = 12.0, -10.0  # one heavy coordinate: the diagonal term matters
    estimates = torch.tensor([float(GradientSketch(d, dim, seed=s)(x) @ GradientSketch(d, dim, seed=s)(y))
                              for s in range(6000)], dtype=torch.float64)
    variance = countsketch_variance(x, y, dim)
    docstring = float(((x @ x) * (y @ y) + (x @ y) ** 2 - 2 * (x.square() @ y.square())) / dim)
    assert docstring == pytest.approx(variance, rel=1e-9)  # the formula the docstring states
    assert abs(float(estimates.mean() - x @ y)) < 4 * math.sqrt(variance / len(estimates))
    assert estimates.var().item() == pytest.approx(variance, rel=0.10)
    # the test can tell the formula from its neighbours: a dense Gaussian map's, and buckets drawn once each
    assert abs(float((x @ x) * (y @ y) + (x @ y) ** 2) / dim / variance - 1) > 0.2
    assert abs((d / dim - 1) / (d - 1) * dim - 1) > 0.2


def test_the_same_seed_gives_the_same_map_everywhere():
    d, dim = 1000, 64
    a, b, c = GradientSketch(d, dim, seed=7), GradientSketch(d, dim, seed=7), GradientSketch(d, dim, seed=8)
    assert torch.equal(a.matrix(), b.matrix()) and not torch.equal(a.matrix(), c.matrix())
    # integer-valued inputs: every sum is exact, so any device must give the same numbers bit for bit
    x = torch.randint(-50, 50, (5, d), generator=torch.Generator().manual_seed(0)).float()
    expected = (x.double() @ a.matrix().T).float()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        assert torch.equal(b(x.to(device)).cpu(), expected), device
    if torch.cuda.is_available():  # real-valued inputs: the same summation order on both
        r = torch.randn(5, d, generator=torch.Generator().manual_seed(1))
        assert torch.allclose(a(r.cuda()).cpu(), a(r), rtol=1e-6, atol=1e-6)
        assert torch.equal(a(r.cuda()), a(r.cuda()))  # deterministic from call to call


def test_tensor_blocks_are_drawn_from_the_seed_alone_and_uniformly():
    """With blocks, the map still depends on (d, dim, seed, blocks) only, whatever torch's global generator did
    before; the row and column hashes take every value in 0..dim-1 (uniform; 200 draws over 4 values miss one
    with probability about 1e-24) and the signs both of +-1."""
    blocks = [(3, 200, 5), (1003, 4, 200)]
    torch.manual_seed(1)
    a = GradientSketch(2000, 4, seed=7, blocks=blocks)
    torch.manual_seed(2)
    b = GradientSketch(2000, 4, seed=7, blocks=blocks)
    assert torch.equal(a.matrix(), b.matrix())
    first, second = a.block_at(3), a.block_at(1003)
    assert set(first.h1.tolist()) == set(second.h2.tolist()) == {0, 1, 2, 3}
    assert set(first.s1.tolist()) == set(second.s2.tolist()) == {-1, 1}


def test_half_precision_in_half_precision_out():
    """A float16 input gives a float16 sketch: the signs are applied in the input's dtype."""
    sketch = GradientSketch(50, 8, seed=3)
    x = torch.randint(-8, 8, (4, 50), generator=torch.Generator().manual_seed(2)).half()  # exact sums
    y = sketch(x)
    assert y.dtype == torch.float16
    assert torch.equal(y.double(), x.double() @ sketch.matrix().T)


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("chunk_columns", [1, 7, 40])
def test_both_accumulation_paths_give_the_dense_maps_numbers_chunk_by_chunk(monkeypatch, in_order, chunk_columns):
    """The CPU's index_add_ path and the other devices' index_put_ path (run here on the CPU), with the signed
    copy made `chunk_columns` input columns at a time (CHUNK_BYTES): integer-valued rows, so every sum is exact
    and both must give x P^T exactly; the copies are of that many columns (the last one what is left)."""
    import sorters.sketch as sketch_module

    n_rows, d, dim = 3, 40, 6
    monkeypatch.setattr(sketch_module, "CHUNK_BYTES", n_rows * 4 * chunk_columns)  # float32 rows
    sketch = GradientSketch(d, dim, seed=5)
    x = torch.randint(-9, 9, (n_rows, d), generator=torch.Generator().manual_seed(3)).float()
    tables = sketch.tables()
    widths = []  # input columns per accumulation: index_add_(1, buckets, (N, w)) / index_put_((buckets,), (w, N))
    index_add, index_put = torch.Tensor.index_add_, torch.Tensor.index_put_
    monkeypatch.setattr(torch.Tensor, "index_add_", lambda out, dim_, index, source: (
        widths.append(source.shape[1]), index_add(out, dim_, index, source))[1])
    monkeypatch.setattr(torch.Tensor, "index_put_", lambda out, indices, values, accumulate=False: (
        widths.append(values.shape[0]), index_put(out, indices, values, accumulate))[1])
    got = sketch._sketch_rows(x, *tables, in_order=in_order)
    monkeypatch.undo()
    assert got.shape == (n_rows, dim) and torch.equal(got.double(), x.double() @ sketch.matrix().T)
    assert widths == [chunk_columns] * (d // chunk_columns) + ([d % chunk_columns] if d % chunk_columns else [])


def test_the_cpu_adds_in_order_and_other_devices_sort_first(monkeypatch):
    """Which accumulation each device gets (the docstring's determinism): index_add_ on the CPU, which adds in
    increasing i; index_put_ with accumulate elsewhere (meta tensors stand in for a GPU), where index_add_ adds
    in any order."""
    sketch = GradientSketch(30, 4, seed=1)
    used = []
    index_add, index_put = torch.Tensor.index_add_, torch.Tensor.index_put_
    monkeypatch.setattr(torch.Tensor, "index_add_", lambda *args: (used.append("index_add_"), index_add(*args))[1])
    monkeypatch.setattr(torch.Tensor, "index_put_", lambda *args, **kwargs: (
        used.append("index_put_"), index_put(*args, **kwargs))[1])
    sketch(torch.zeros(2, 30))
    assert set(used) == {"index_add_"}
    used.clear()
    sketch(torch.zeros(2, 30, device="meta"))
    assert set(used) == {"index_put_"}


def test_the_map_is_drawn_as_documented():
    """h_i, then s_i, all d of each, from a torch.Generator seeded with seed + SEED_OFFSET (the docstring's
    recipe, rebuilt here); the default seed is 0."""
    from sorters.sketch import SEED_OFFSET

    d, dim = 60, 7
    for seed in (0, 4):
        generator = torch.Generator().manual_seed(seed + SEED_OFFSET)
        buckets = torch.randint(0, dim, (d,), generator=generator)
        signs = torch.randint(0, 2, (d,), generator=generator) * 2 - 1
        P = torch.zeros(dim, d, dtype=torch.float64)
        P[buckets, torch.arange(d)] = signs.double()
        assert torch.equal(GradientSketch(d, dim, seed=seed).matrix(), P), seed
    assert torch.equal(GradientSketch(d, dim).matrix(), GradientSketch(d, dim, seed=0).matrix())


@pytest.mark.parametrize("chunk", [7, 60, 2**22])
def test_the_map_with_blocks_is_drawn_as_documented_whatever_the_draw_chunk(chunk, monkeypatch):
    """With blocks: the d bucket draws and the d sign draws as above (those inside a block unused), then
    each block's h1, h2, s1, s2 in offset order; the tables are built DRAW_CHUNK draws at a time, which
    must not change a number (the recipe here draws all d at once)."""
    import sorters.sketch
    from sorters.sketch import SEED_OFFSET

    monkeypatch.setattr(sorters.sketch, "DRAW_CHUNK", chunk)
    d, dim, seed, blocks = 95, 11, 3, [(40, 5, 6), (4, 3, 4)]  # given out of order
    generator = torch.Generator().manual_seed(seed + SEED_OFFSET)
    buckets = torch.randint(0, dim, (d,), generator=generator)
    signs = torch.randint(0, 2, (d,), generator=generator) * 2 - 1
    for offset, rows, cols in sorted(blocks):
        h1, h2 = torch.randint(0, dim, (rows,), generator=generator), torch.randint(0, dim, (cols,), generator=generator)
        s1 = torch.randint(0, 2, (rows,), generator=generator) * 2 - 1
        s2 = torch.randint(0, 2, (cols,), generator=generator) * 2 - 1
        span = slice(offset, offset + rows * cols)
        buckets[span] = ((h1[:, None] + h2[None, :]) % dim).reshape(-1)
        signs[span] = (s1[:, None] * s2[None, :]).reshape(-1)
    P = torch.zeros(dim, d, dtype=torch.float64)
    P[buckets, torch.arange(d)] = signs.double()
    sketch = GradientSketch(d, dim, seed=seed, blocks=blocks)
    assert torch.equal(sketch.matrix(), P)
    assert sketch.outside.tolist() == [*range(4), *range(16, 40), *range(70, 95)]
    assert torch.equal(GradientSketch(d, dim, seed=seed).matrix()[:, sketch.outside], P[:, sketch.outside])


def test_the_smallest_sizes_and_every_bad_block():
    """d = 1 and dim = 1 are fine (every coordinate into one bucket); a block must lie inside the d
    coordinates, not overlap another, and have rows and columns (one of each is enough)."""
    assert GradientSketch(1, 1).is_identity
    one_bucket = GradientSketch(5, 1, seed=2)
    x = torch.arange(5.0)
    assert one_bucket.dim == 1 and torch.equal(one_bucket(x).double(), one_bucket.matrix() @ x.double())
    GradientSketch(10, 3, blocks=[(4, 2, 3)])  # ends at coordinate 10 = d
    GradientSketch(10, 3, blocks=[(0, 3, 1), (3, 1, 1)])  # one column; one row; touching, not overlapping
    for blocks in ([(5, 2, 3)], [(0, 0, 3)], [(0, 3, 0)], [(0, 2, 2), (3, 1, 2)]):
        with pytest.raises(ValueError) as info:
            GradientSketch(10, 3, blocks=blocks)
        offset, rows, cols = blocks[-1]
        assert str(info.value) == (f"GradientSketch: block ({offset}, {rows}, {cols}) overlaps another or leaves "
                                   "the 10 coordinates")


@pytest.mark.parametrize("per_group", [1, 2])
def test_add_outer_goes_through_the_units_in_groups(monkeypatch, per_group):
    """CHUNK_BYTES bounds the spectra: add_outer takes CHUNK_BYTES // (T * dim * 2 * element size) units at a
    time (at least one), here 1 or 2 of 3, with the result of taking all three at once."""
    import sorters.sketch as sketch_module

    U, T, rows, cols, dim = 3, 5, 4, 6, 7
    sketch = GradientSketch(40, dim, seed=3, blocks=[(2, rows, cols)])
    block = sketch.block_at(2)
    generator = torch.Generator().manual_seed(4)
    left = torch.randn(U, T, rows, generator=generator, dtype=torch.float64)
    right = torch.randn(U, T, cols, generator=generator, dtype=torch.float64)
    at_once = torch.zeros(U, dim, dtype=torch.float64)
    block.add_outer(left, right, at_once)
    monkeypatch.setattr(sketch_module, "CHUNK_BYTES", T * dim * 2 * 8 * per_group)
    transformed = []  # the rows of each rfft: (units in the group) * T
    rfft = torch.fft.rfft
    monkeypatch.setattr(torch.fft, "rfft", lambda x, *args, **kwargs: (transformed.append(x.shape[0]),
                                                                      rfft(x, *args, **kwargs))[1])
    grouped = torch.zeros(U, dim, dtype=torch.float64)
    block.add_outer(left, right, grouped)
    monkeypatch.undo()
    groups = [per_group] * (U // per_group) + ([U % per_group] if U % per_group else [])
    assert transformed == [size * T for size in groups for _ in range(2)]  # the rows' and the columns' spectra
    assert torch.allclose(grouped, at_once, rtol=0, atol=1e-12)


def test_identity_and_bad_sizes():
    x = torch.randn(3, 10)
    for sketch in (GradientSketch.identity(10), GradientSketch(10, 10), GradientSketch(10, 99)):
        assert sketch.is_identity and sketch.dim == 10 and sketch(x) is x
    with pytest.raises(ValueError, match="shape"):
        GradientSketch(10, 4)(torch.zeros(3, 11))
    with pytest.raises(ValueError, match="dim >= 1"):
        GradientSketch(10, 0)


def test_repr_and_the_identitys_matrix():
    assert repr(GradientSketch(10, 4, seed=3)) == "GradientSketch(d=10, dim=4: CountSketch, seed 3)"
    assert repr(GradientSketch(30, 4, seed=1, blocks=[(6, 3, 4)])) == \
        "GradientSketch(d=30, dim=4: CountSketch with 1 TensorSketch block(s), seed 1)"
    assert repr(GradientSketch(3, 5)) == "GradientSketch(d=3, dim=3: identity)"
    identity = GradientSketch.identity(3)
    assert torch.equal(identity.matrix(), torch.eye(3, dtype=torch.float64))
    assert identity.matrix().dtype == torch.float64 and identity.matrix(torch.float32).dtype == torch.float32


@pytest.mark.parametrize("dim", [7, 2])  # 2: the 6 rows are wider than 2 D (the unsigned 2 D-bucket path)
def test_a_tensor_block_sketches_outer_products_and_rows_as_the_dense_map_in_either_precision(dim):
    """TensorBlock.add_outer (sum_t u_t v_t^T) and add_rows (sum_t e_{id_t} v_t^T) against the dense map
    (matrix(), itself checked against the basis vectors above) applied to the formed (rows, cols) matrices,
    in float64 and then float32 on the same block (each precision gets its own signs)."""
    offset, rows, cols, d = 5, 6, 4, 40
    sketch = GradientSketch(d, dim, seed=2, blocks=[(offset, rows, cols)])
    block = sketch.block_at(offset)
    P = sketch.matrix()[:, offset:offset + rows * cols]  # (dim, rows * cols)
    generator = torch.Generator().manual_seed(1)
    U, T = 3, 5
    left, right = torch.randn(U, T, rows, generator=generator), torch.randn(U, T, cols, generator=generator)
    ids = torch.randint(0, rows, (U, T), generator=generator)
    for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        outer = torch.einsum("uti,utj->uij", left.double(), right.double()).reshape(U, -1)
        got = torch.zeros(U, dim, dtype=dtype)
        block.add_outer(left.to(dtype), right.to(dtype), got)
        assert torch.allclose(got.double(), outer @ P.T, rtol=0, atol=tolerance), dtype
        one_hot = torch.nn.functional.one_hot(ids, rows).double()
        scattered = torch.einsum("uti,utj->uij", one_hot, right.double()).reshape(U, -1)
        got = torch.zeros(U, dim, dtype=dtype)
        block.add_rows(ids, right.to(dtype), got)
        assert torch.allclose(got.double(), scattered @ P.T, rtol=0, atol=tolerance), dtype


def test_the_map_and_its_blocks_follow_the_input_to_its_device():
    """Every table moves to the input's device (the non-CPU path: index_put_). Meta tensors (shapes and
    devices, no values) stand in for a GPU on a machine without one."""
    sketch = GradientSketch(30, 4, seed=1, blocks=[(6, 3, 4)])
    y = sketch(torch.zeros(2, 30, device="meta"))
    assert y.device.type == "meta" and y.shape == (2, 4)
    block = sketch.block_at(6)
    out = torch.zeros(2, 4, device="meta")
    block.add_outer(torch.zeros(2, 5, 3, device="meta"), torch.zeros(2, 5, 4, device="meta"), out)
    block.add_rows(torch.zeros(2, 5, dtype=torch.long, device="meta"), torch.zeros(2, 5, 4, device="meta"), out)
    assert out.device.type == "meta"


# ------------------------------------------------------------------------------------------- the sampler


def sampler_orders(sampler, table, epochs=3, transform=lambda g: g):
    """(epochs, n, m) dataset indices of a sampler hosting every replica, fed transform(table rows)."""
    seen = []
    for _ in range(epochs):
        indices = torch.tensor(list(sampler))
        for batch in indices.split(sampler.loader_batch_size):
            sampler.step(transform(table[batch]))
        seen.append(sampler.all_indices())
    return torch.stack(seen)


def test_the_sampler_balances_the_sketches_and_its_identity_is_exact():
    n, m, k, d, dim = 3, 20, 2, 50, 8
    # integer-valued "gradients": the sketch's sums are exact, so the oracle below sees the same numbers
    table = torch.randint(-9, 10, (n * m, d), generator=torch.Generator().manual_seed(2)).float()
    P = GradientSketch(d, dim, seed=5).matrix().float()

    def sampler(**kw):
        return CDGraBSampler(n * m, batch_size=k, num_replicas=n, seed=5, **kw)

    sketched = sampler_orders(sampler(d=d, sketch_dim=dim), table)
    oracle = sampler_orders(sampler(d=dim), table @ P.T)  # exact CD-GraB on explicit sketches
    assert torch.equal(sketched, oracle)
    exact = sampler_orders(sampler(d=d), table)
    assert not torch.equal(sketched[1:], exact[1:])  # the sketch changed what was balanced
    assert torch.equal(sampler_orders(sampler(d=d, sketch_dim=d), table), exact)  # identity: bit for bit
    assert torch.equal(sampler_orders(sampler(d=d, sketch_dim=5 * d), table), exact)
    # gradients sketched beforehand (PerExampleGrads(sketch_dim, sketch_seed)) give the same orders
    pre = sampler_orders(sampler(d=d, sketch_dim=dim), table, transform=GradientSketch(d, dim, seed=5))
    assert torch.equal(pre, sketched)
    with pytest.raises(ValueError, match="sketch_dim"):
        sampler(d=d, sorter="D-RR", sketch_dim=dim)


def test_per_example_grads_sketch_what_they_would_return():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    x, y = torch.randn(7, 6), torch.randn(7, 2)
    loss = torch.nn.functional.mse_loss
    full = PerExampleGrads(model, loss)(x, y)
    grads_of = PerExampleGrads(model, loss, sketch_dim=9, sketch_seed=3)
    assert (grads_of.d, grads_of.dim) == (full.shape[1], 9)
    assert torch.equal(grads_of(x, y), GradientSketch(full.shape[1], 9, seed=3)(full))
    out = torch.empty(7, 9)
    assert grads_of(x, y, out=out) is out and torch.equal(out, grads_of(x, y))


# ------------------------------------------------------------------------------------------- the exchange


class RecordingComm(LocalCommunicator):
    """One process's communicator that records the shape of every tensor handed to all_gather."""

    def __init__(self, n):
        super().__init__(n)
        self.gathered = []

    def all_gather(self, local):
        self.gathered.append(tuple(local.shape))
        return local


def test_the_exchange_gathers_sketches_and_all_reduces_the_update():
    n, k, d, dim = 4, 3, 40, 6
    sketch = GradientSketch(d, dim, seed=0)
    comm = RecordingComm(n)
    exchange = GradientExchange(comm, gather_unit_grads=True, reducer=make_reducer("dense", comm, d, "cpu"),
                                sketch=sketch)
    grads = torch.randn(n, k, d)
    update, every = exchange.exchange(grads, None)
    assert comm.gathered == [(n, k, dim)]  # sketched before the gather, not after
    assert torch.equal(every, sketch(grads))
    assert torch.allclose(update, grads.mean(dim=(0, 1)))
    assert exchange.comm_bytes == 4 * (n * k * dim + n * d)  # the sketches, and one d-vector per worker
    # local steps defer the unit gradients of a round: kept and gathered as sketches, in step order
    second = torch.randn(n, k, d)
    exchange.defer_unit_grads(grads, range(0, k))
    exchange.defer_unit_grads(second, range(k, 2 * k))
    flushed = exchange.flush_unit_grads()
    assert comm.gathered[1:] == [(n, 2, k, dim)]
    assert torch.equal(flushed[0][0], sketch(grads)) and torch.equal(flushed[1][0], sketch(second))
    # with each worker's own gradient (--reducer / --sync), the update is the reducer's
    update, _ = exchange.exchange(grads, None, grads.mean(1))
    assert torch.allclose(update, grads.mean(dim=(0, 1)))


# ------------------------------------------------------------------------------------------- end to end

M4 = "m4/Weekly-train.csv"
SCRIPT = "main-MLP-M4.py"
D_MLP = 5_569
QUICK = ["--B", "4", "--node_cnt", "2", "--lr", "5e-4", "--max-train-examples", "128",
         "--max-eval-examples", "128", "--epochs", "2", "--record-orders"]
COLUMNS = ("train_loss", "test_loss", "valid_loss", "test_smape")
STEPS, N, K = 32, 2, 2  # QUICK's 64 windows per worker, 2 per step


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Exact CD-GraB and D = 64 (both with --log-herding), the identity sketch (--sketch-dim d, with CD-GraB's
    Gram sign loop instead of the compiled one: the same signs), and D = 128."""
    root = tmp_path_factory.mktemp("sketch")
    flags = {"exact": ["--log-herding"], "identity": ["--sketch-dim", D_MLP, "--sign-loop", "gram"],
             "64": ["--sketch-dim", 64, "--log-herding"],
             "128": ["--sketch-dim", 128]}
    for name, extra in flags.items():
        check_ok(run_script(SCRIPT, "--out", root / name, *QUICK, *extra))
    return {name: root / name for name in flags}


@pytest.mark.slow
@needs_data(M4)
def test_identity_sketch_is_exact_cd_grab_bit_for_bit(runs):
    configs = [json.loads((runs[name] / "config.json").read_text())["sorter"] for name in ("exact", "identity")]
    assert [c["sign_loop"] for c in configs] == ["compiled", "gram"]
    exact, identity = torch.load(runs["exact"] / "orders.pt"), torch.load(runs["identity"] / "orders.pt")
    assert all(torch.equal(a, b) for a, b in zip(exact, identity)) and len(exact) == 2
    for a, b in zip(read_metrics(runs["exact"]), read_metrics(runs["identity"])):
        assert all(a[c] == b[c] for c in (*COLUMNS, "comm_bytes"))


@pytest.mark.slow
@needs_data(M4)
def test_sketched_orders_are_permutations_and_bytes_scale_with_d(runs):
    """comm_bytes per epoch = steps * 4 * (n*k*D sketch floats gathered + n*d update floats all-reduced)."""
    for D in (64, 128):
        orders = check_run_files(runs[str(D)], epochs=2, m=64)
        assert not torch.equal(orders[1], torch.load(runs["exact"] / "orders.pt")[1])
        config = json.loads((runs[str(D)] / "config.json").read_text())
        assert config["args"]["sketch_dim"] == D and config["sorter"]["sketch"]["applied"]
        for row in read_metrics(runs[str(D)]):
            assert row["comm_bytes"] == STEPS * 4 * (N * K * D + N * D_MLP)
    for row in read_metrics(runs["exact"]):
        assert row["comm_bytes"] == STEPS * 4 * N * K * D_MLP
    # the herding bound is that of the real gradients: epoch 1 (the seed's random order, the same updates as
    # exact CD-GraB in one process) gives exact CD-GraB's bound exactly
    herding = [r["herding_bound"] for r in read_metrics(runs["64"])]
    assert herding[0] == read_metrics(runs["exact"])[0]["herding_bound"] and all(map(math.isfinite, herding))


@pytest.mark.slow
@needs_data(M4)
def test_sketched_one_process_equals_torchrun(runs, tmp_path):
    check_torchrun_agrees(SCRIPT, runs["64"], tmp_path / "nproc2", *QUICK, "--sketch-dim", 64, "--log-herding",
                          columns=(*COLUMNS, "herding_bound"))


@pytest.mark.slow
@needs_data(M4)
def test_bad_sketch_flags_fail_in_one_line(runs, tmp_path):
    for extra, message in ((["--sorter", "D-RR", "--sketch-dim", "8"], "--sketch-dim applies to the sorters"),
                           (["--sketch-dim", "-1"], "--sketch-dim: must be >= 0"),
                           (["--sketch-dim", "8", "--sketch-min-numel", "0"], "--sketch-min-numel: must be >= 1"),
                           (["--sketch-min-numel", "64"], "--sketch-min-numel applies to a sketch"),
                           (["--sorter", "D-RR", "--sign-loop", "gram"], "--sign-loop chooses CD-GraB's sign loop; "
                                                                         "D-RR has none to choose: drop it")):
        result = run_script(SCRIPT, "--out", tmp_path / "bad", *QUICK, *extra)
        assert result.returncode == 2 and len(error_lines(result)) == 1 and message in result.stderr, result.stderr
        assert not (tmp_path / "bad").exists()
    # the sketch dimension cannot change on --resume
    result = run_script(SCRIPT, "--out", runs["128"], *QUICK, "--epochs", "3", "--sketch-dim", "64", "--resume")
    assert result.returncode == 2 and "--sketch-dim 128 (now 64)" in result.stderr, result.stderr


def test_the_default_out_names_the_sketch_dimension():
    from engine.cli import check_args, common_parser

    parser = common_parser("MLP-M4", "", dict(sorter="CD-GraB", lr=1e-3, B=32, node_cnt=32, epochs=50))
    for argv, tag in ((["--sketch-dim", "256"], "-sketch-dim256-seed0"), ([], "-lr0.001-seed0"),
                      (["--sketch-dim", "64", "--sketch-min-numel", "512"], "-sketch-dim64-sketch-min-numel512-seed0")):
        args = parser.parse_args(argv)
        check_args(args, "MLP-M4", defaults=vars(parser.parse_args([])))
        assert args.out.endswith(tag), args.out


# the other two benchmarks (MLP-M4 above, GPT-2 in test_sketch_records.py): 2 workers, D below d, so the
# map is not the identity; bytes per step 4 (n k D + n d) with k = B / n units per worker per step
OTHER_BENCHMARKS = {
    "main-LR-HMDA.py": (["--B", "4", "--node_cnt", "2", "--max-train-examples", "64", "--max-eval-examples", "64",
                         "--epochs", "2", "--record-orders", "--sketch-dim", "8"], 26, 8, ("train_loss", "test_loss")),
    "main-LSTM-Wiki2.py": (["--B", "4", "--node_cnt", "2", "--bptt", "10", "--lr", "2", "--max-train-examples", "12",
                            "--max-eval-examples", "2", "--epochs", "2", "--record-orders", "--sketch-dim", "64"],
                           None, 64, ("train_loss", "valid_loss")),
}


@needs_data
@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(OTHER_BENCHMARKS))
def test_sketched_lr_and_lstm_send_sketches_and_one_process_equals_torchrun(script, tmp_path):
    args, d, D, columns = OTHER_BENCHMARKS[script]
    single = tmp_path / "one"
    check_ok(run_script(script, "--out", single, *args))
    config = json.loads((single / "config.json").read_text())
    assert config["sorter"]["sketch"]["sketch_dim"] == D and config["sorter"]["sketch"]["applied"]
    sizes = config["sizes"]
    d = d or sizes["d"]
    n, k = sizes["n_workers"], sizes["units_per_step"]
    assert sizes["d"] == d and D < d
    # --sign-loop auto: the Gram loop for sketches of the LSTM's 1,081,792 parameters, numba's for LR's 26
    assert config["sorter"]["sign_loop"] == ("gram" if d >= 2**20 else "compiled")
    for row in read_metrics(single):
        assert row["comm_bytes"] == sizes["steps_per_epoch"] * 4 * (n * k * D + n * d)
    check_torchrun_agrees(script, single, tmp_path / "two", *args, columns=columns)


def test_sign_loop_auto_follows_the_sorters_rule_and_compiled_stays_on_the_cpu():
    from argparse import Namespace

    from common.errors import UserFacingError
    from engine.run_setup import resolve_sign_loop

    for sorter, sign_loop, device, d, sorted_d, expected in (
            ("CD-GraB", "auto", "cpu", 2**20, 64, "gram"), ("CD-GraB", "auto", "cpu", 2**20, 2**20, "compiled"),
            ("CD-GraB", "auto", "cpu", 2**19, 64, "compiled"), ("CD-GraB", "auto", "meta", 26, 26, "gram"),
            ("CD-GraB", "compiled", "cpu", 2**20, 64, "compiled"), ("CD-GraB", "gram", "cpu", 26, 26, "gram"),
            ("KH-SGD", "auto", "cpu", 2**20, 64, None), ("D-RR", "auto", "meta", 26, 26, None)):
        args = Namespace(sorter=sorter, sign_loop=sign_loop)
        assert resolve_sign_loop(args, device, d, sorted_d) == expected, (sorter, sign_loop, device, d, sorted_d)
    with pytest.raises(UserFacingError) as info:
        resolve_sign_loop(Namespace(sorter="CD-GraB", sign_loop="compiled"), "meta", 26, 26)
    assert str(info.value) == "--sign-loop compiled runs on the CPU only; on meta use gram or auto"


def test_sketch_min_numel_makes_every_layer_weight_of_that_size_a_block():
    """--sketch-min-numel N: the map's TensorSketch blocks are exactly the MLP's Linear weights of >= N
    entries, at their offsets in the flat parameter vector (read off named_parameters here); config.json
    records them; the default (2^20) leaves this model a plain CountSketch."""
    from argparse import Namespace

    from engine.functional import FlatModel
    from engine.sketching import STRUCTURED_MIN_NUMEL, make_sketch, sketch_config
    from models.mlp import AutoregressiveMLP

    module = AutoregressiveMLP(in_len=24, hidden=40, n_layers=3)
    model = FlatModel(module)
    offset, expected = 0, []
    for name, p in module.named_parameters():
        if name.endswith("weight") and p.dim() == 2 and p.numel() >= 900:
            expected.append([offset, *p.shape])
        offset += p.numel()
    assert len(expected) >= 2 and offset == model.flat.numel()
    args = Namespace(sketch_dim=64, sketch_min_numel=900, seed=3)
    sketch = make_sketch(args, offset, model)
    assert [[b.offset, b.rows, b.cols] for b in sketch.blocks] == expected
    config = sketch_config(args, sketch)
    assert config["blocks"] == expected and config["min_numel"] == 900 and config["family"] != "CountSketch"
    plain = make_sketch(Namespace(sketch_dim=64, sketch_min_numel=STRUCTURED_MIN_NUMEL, seed=3), offset, model)
    assert plain.blocks == [] and plain.family == "CountSketch"
