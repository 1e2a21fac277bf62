"""engine.comm.GradientExchange against the mean written out: what each step's update is, and the bytes it
counts, in one process and over two gloo processes (4 workers); and the library's sketch-then-gather
(sorters/gather.py) that it and CDGraBSampler share, against the concatenation of every process's rows
sketched on their own: sketched before the wire, in rank order, one process = two bit for bit."""
import os
import socket

import torch
import torch.multiprocessing as mp

from engine.comm import DistributedCommunicator, GradientExchange, LocalCommunicator
from engine.reducers import make_reducer
from sorters.gather import all_gather_rows, sketch_then_gather
from sorters.sketch import GradientSketch

N, K, D = 4, 3, 7  # workers, units per worker per step, gradient length
S = 3              # sketch width


def unit_grads(workers) -> torch.Tensor:
    """(len(workers), K, D) per-unit gradients, a function of the worker id only."""
    return torch.stack([torch.randn(K, D, generator=torch.Generator().manual_seed(100 + w)) for w in workers])


def exchanges(comm) -> dict:
    """This process's results of the three ways a step exchanges gradients."""
    local = unit_grads(comm.local_workers)  # (n_local, K, D)
    results = {}
    # D-RR & co.: one all-reduce of this process's mean gradient
    plain = GradientExchange(comm, gather_unit_grads=False)
    update, every = plain.exchange(None, local.mean(dim=(0, 1)))
    results["mean"] = (update.clone(), every, plain.comm_bytes)
    # balancing sorters: the unit gradients all-gathered, the update their mean
    gather = GradientExchange(comm, gather_unit_grads=True)
    update, every = gather.exchange(local, None)
    results["gather"] = (update.clone(), every.clone(), gather.comm_bytes)
    # post-local before its switch with a balancing sorter: the workers' gradients are given too, but the
    # gathered unit gradients already hold the mean, so the dense reducer must not send them again
    reducer = make_reducer("dense", comm, D, "cpu")
    both = GradientExchange(comm, gather_unit_grads=True, reducer=reducer)
    update, every = both.exchange(local, None, local.mean(dim=1))
    results["post-local"] = (update.clone(), every.clone(), both.comm_bytes + reducer.comm_bytes)
    # --sketch-dim: the workers' unit gradients sketched before the gather, the update all-reduced
    sketched = GradientExchange(comm, gather_unit_grads=True, sketch=GradientSketch(D, S, seed=1))
    update, every = sketched.exchange(local, None)
    results["sketched"] = (update.clone(), every.clone(), sketched.comm_bytes)
    # local SGD: two steps' unit gradients deferred (sketched as they come), gathered in one collective
    deferred = GradientExchange(comm, gather_unit_grads=True, sketch=GradientSketch(D, S, seed=1))
    deferred.defer_unit_grads(local, "step 0")
    deferred.defer_unit_grads(2 * local, "step 1")
    results["deferred"] = ([(every.clone(), positions) for every, positions in deferred.flush_unit_grads()],
                           deferred.comm_bytes)
    return results


def check(results):
    everything = unit_grads(range(N))
    mean = everything.mean(dim=(0, 1))
    update, every, sent = results["mean"]
    torch.testing.assert_close(update, mean, rtol=0, atol=1e-6)
    assert every is None and sent == N * D * 4  # one float32 D-vector per worker
    for name in ("gather", "post-local"):
        update, every, sent = results[name]
        torch.testing.assert_close(update, mean, rtol=0, atol=1e-6)
        assert torch.equal(every, everything)
        assert sent == N * K * D * 4, name  # every worker's K unit gradients, and nothing more
    P = GradientSketch(D, S, seed=1).matrix()  # (S, D) float64: the oracle sketches by a matrix product
    update, every, sent = results["sketched"]
    torch.testing.assert_close(update, mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(every, (everything.double() @ P.T).float(), rtol=0, atol=1e-6)
    assert sent == N * K * S * 4 + N * D * 4  # sketches gathered, the mean all-reduced
    steps, sent = results["deferred"]
    assert [positions for _, positions in steps] == ["step 0", "step 1"]
    for scale, (every, _) in zip((1, 2), steps):
        torch.testing.assert_close(every, (scale * everything.double() @ P.T).float(), rtol=0, atol=1e-6)
    assert sent == N * 2 * K * S * 4


class DenseMap:
    """A stand-in sketch: a fixed random (S, D) matrix, (..., D) -> (..., S); it records the shapes it maps."""
    d = D

    def __init__(self):
        self.matrix, self.mapped = torch.randn(S, D, generator=torch.Generator().manual_seed(7)), []

    def __call__(self, rows):
        self.mapped.append(tuple(rows.shape))
        return rows @ self.matrix.T


def library_gathers(workers, gather) -> dict:
    """sorters.gather.sketch_then_gather of this process's workers' (n_local, K, D) rows, with `gather` (None:
    one process hosts every worker) wrapped to record the shapes that go on the wire."""
    local, dense, wire = unit_grads(workers), DenseMap(), []

    def recorded(rows):
        wire.append(tuple(rows.shape))
        return gather(rows)

    through = recorded if gather is not None else None
    strided = local.transpose(0, 1).contiguous().transpose(0, 1)  # the same rows, not contiguous
    return {"dense": sketch_then_gather(local, dense, through),
            "countsketch": sketch_then_gather(local, GradientSketch(D, S, seed=1), through),
            "sketched already": sketch_then_gather(dense(local), dense, through),
            "unsketched": sketch_then_gather(strided, None, through),
            "mapped": dense.mapped, "wire": wire}


def check_library_gathers(results, n_local):
    """Against the oracle: every worker's rows sketched on their own (by the dense map, by the CountSketch's
    matrix), concatenated in worker order; only this process's rows sketched, only sketches on the wire."""
    everything = unit_grads(range(N))
    dense_oracle = torch.cat([unit_grads([w]) @ DenseMap().matrix.T for w in range(N)])  # (N, K, S)
    torch.testing.assert_close(results["dense"], dense_oracle, rtol=0, atol=1e-6)
    torch.testing.assert_close(results["sketched already"], dense_oracle, rtol=0, atol=1e-6)
    P = GradientSketch(D, S, seed=1).matrix()
    torch.testing.assert_close(results["countsketch"], (everything.double() @ P.T).float(), rtol=0, atol=1e-6)
    assert torch.equal(results["unsketched"], everything)
    # the dense map saw this process's rows only: in sketch_then_gather, and where the test sketched them itself
    assert results["mapped"] == [(n_local, K, D)] * 2
    gathered = n_local < N
    assert results["wire"] == ([(n_local, K, S)] * 3 + [(n_local, K, D)] if gathered else [])


def test_exchange_in_one_process():
    check(exchanges(LocalCommunicator(N)))
    check_library_gathers(library_gathers(range(N), None), N)


def test_exchange_in_one_process():
    check(exchanges(LocalCommunicator(N)))


def distributed_exchanges(rank: int, world_size: int, port: int, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    comm = DistributedCommunicator(N, "cpu", "gloo", 60)
    torch.save(exchanges(comm), os.path.join(out_dir, f"rank{rank}.pt"))
    torch.save(library_gathers(comm.local_workers, all_gather_rows), os.path.join(out_dir, f"library{rank}.pt"))
    comm.close(finished=True)


def test_exchange_over_two_gloo_processes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(distributed_exchanges, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    one_process = exchanges(LocalCommunicator(N))
    one_process_library = library_gathers(range(N), None)
    for rank in range(2):
        results, library = torch.load(tmp_path / f"rank{rank}.pt"), torch.load(tmp_path / f"library{rank}.pt")
        check(results)
        check_library_gathers(library, N // 2)
        # one process hosting the 4 workers = 2 processes of 2, bit for bit
        assert torch.equal(results["sketched"][1], one_process["sketched"][1])
        assert torch.equal(library["countsketch"], one_process_library["countsketch"])
