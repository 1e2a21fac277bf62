"""CD-GraB under local SGD: all-gather the unit gradients every step, or once per round of H steps?

    OMP_NUM_THREADS=1 python bench/gather_batching.py            # 2 gloo processes, MLP-M4's sizes

Both move the same bytes; batching trades H latency-bound collectives for one H times larger (and
H times the memory, and the balancing delayed to the round's end). Two processes (gloo, this CPU) time
`rounds` rounds of H steps each way, interleaved, and print one JSON object: seconds per step of each,
their ratio, and the bytes per step (the same for both).
"""
import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    local = torch.randn(args.n_local, args.k, args.d)
    results = {}
    for H in args.H:
        out_step = torch.empty(world * args.n_local, args.k, args.d)
        batched_in = torch.randn(H, args.n_local, args.k, args.d)
        out_round = torch.empty(world * H, args.n_local, args.k, args.d)
        per_step, per_round = [], []
        for _ in range(args.rounds):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(H):
                dist.all_gather_into_tensor(out_step, local)
            per_step.append((time.perf_counter() - start) / H)
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather_into_tensor(out_round, batched_in)
            per_round.append((time.perf_counter() - start) / H)
        results[H] = (statistics.median(per_step), statistics.median(per_round))
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, default=5569, help="parameters (MLP-M4: 5,569)")
    parser.add_argument("--k", type=int, default=4, help="units per worker per step")
    parser.add_argument("--n-local", type=int, default=2, help="workers per process (4 workers on 2 processes)")
    parser.add_argument("--H", type=int, nargs="+", default=[4, 16, 64], help="round lengths")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per H (median reported)")
    args = parser.parse_args()
    world = 2
    context = mp.get_context("spawn")
    queue = context.Queue()
    mp.spawn(worker, args=(world, free_port(), args, queue), nprocs=world, join=True)
    results = queue.get()
    bytes_per_step = world * args.n_local * args.k * args.d * 4
    print(json.dumps({
        "bytes_per_step": bytes_per_step,
        "per_H": {str(H): {"every_step_us": round(a * 1e6, 1), "batched_per_round_us": round(b * 1e6, 1),
                           "ratio_every_step_over_batched": round(a / b, 2)} for H, (a, b) in results.items()},
        "settings": {"processes": world, "backend": "gloo", **{k: v for k, v in vars(args).items()}},
    }, indent=1))


if __name__ == "__main__":
    main()
