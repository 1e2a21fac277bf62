"""engine.comm.GradientExchange against the mean written out: what each step's update is, and the bytes it
counts, in one process and over two gloo processes (4 workers)."""
import os
import socket

import torch
import torch.multiprocessing as mp

from engine.comm import DistributedCommunicator, GradientExchange, LocalCommunicator
from engine.reducers import make_reducer

N, K, D = 4, 3, 7  # workers, units per worker per step, gradient length


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


def test_exchange_in_one_process():
    check(exchanges(LocalCommunicator(N)))


def distributed_exchanges(rank: int, world_size: int, port: int, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    comm = DistributedCommunicator(N, "cpu", "gloo", 60)
    torch.save(exchanges(comm), os.path.join(out_dir, f"rank{rank}.pt"))
    comm.close(finished=True)


def test_exchange_over_two_gloo_processes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(distributed_exchanges, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        check(torch.load(tmp_path / f"rank{rank}.pt"))
