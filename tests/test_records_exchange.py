"""sorters.gather.Exchange, the bucketed exchange of records (docs/fsdp.md, "The cost"), on 2 forked gloo
processes, against an oracle that needs no packing: each tensor all-gathered on its own (torch.distributed's
all_gather into a list), a to_owners tensor's rows of this process cut from those whole tensors by hand, and a
to_owner tensor kept by its owner only."""
import os
import socket

import pytest
import torch

from sorters.gather import Exchange
from tests.helpers import run_forked

U = 3  # units a process


def tensors(rank):
    """This process's registered tensors: (kind, tensor, dim, splits), floats and int64 ids, of sizes that fill
    several buckets of a few hundred bytes, one larger than a bucket, one with no rows for process 1."""
    g = torch.Generator().manual_seed(10 + rank)
    return [
        ("whole", torch.randn(U, 4, 5, generator=g), 0, None),
        ("owned", torch.randn(U, 4, 7, generator=g), 2, [(0, 4), (4, 7)]),
        ("whole", torch.randint(0, 50, (U, 4), generator=g), 0, None),
        ("owned", torch.randn(U, 9, 2, generator=g), 1, [(0, 5), (5, 9)]),
        ("whole", torch.randn(U, 40, 6, generator=g)[:, ::2], 0, None),  # larger than a bucket; not contiguous
        ("owned", torch.randn(U, 3, generator=g), 1, [(0, 3), (3, 3)]),  # process 1 owns no row
        ("whole", torch.randn(U, generator=g).double(), 0, None),
        ("owned", torch.randn(U, 30, 8, generator=g), 1, [(0, 15), (15, 30)]),
        ("owner", torch.randn(U, 6, generator=g), 1, None),  # to process 1 alone
        ("owner", torch.randint(0, 9, (U, 2), generator=g), 0, None),
        ("owner", torch.randn(U, 50, 3, generator=g), 0, None),  # larger than a bucket
        ("owner", torch.randn(U, 2, generator=g), 1, None),
    ]


def exchange_rank(rank, port, path, bucket_bytes, asynchronous):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        Exchange.BUCKET_BYTES = bucket_bytes  # (this forked process only)
        exchange, handles = Exchange(), []
        for kind, x, dim, splits in tensors(rank):
            handles.append(exchange.gather(x) if kind == "whole" else exchange.to_owner(x, dim) if kind == "owner"
                           else exchange.to_owners(x, dim, splits))
        works = [] if asynchronous else None
        exchange.start(works)
        for work, _ in works or []:
            work.wait()
        got = [None if (result := exchange.result(handle)) is None else result.clone() for handle in handles]
        expected = []
        for kind, x, dim, splits in tensors(rank):
            every = [torch.empty_like(x.contiguous()) for _ in range(2)]
            torch.distributed.all_gather(every, x.contiguous())
            if kind == "owned":
                r0, r1 = splits[rank]
                every = [t.narrow(dim, r0, r1 - r0) for t in every]
            expected.append(None if kind == "owner" and dim != rank else torch.cat(every))
        torch.save({"got": got, "expected": expected}, f"{path}.rank{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("bucket_bytes,asynchronous", [(400, False), (400, True), (2**30, False)])
def test_every_tensor_arrives_as_its_own_all_gather_gives_it(tmp_path, bucket_bytes, asynchronous):
    """Each registered tensor's result equals every process's copy of it (rank-major), or of the rows this process
    owns, or, for a tensor to one owner, that in the owner and None in the other, bit for bit: in buckets of 400
    bytes received (several a dtype and kind, the large tensors alone), started asynchronously too, and in one
    bucket a dtype and kind."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    run_forked(exchange_rank, (port, tmp_path / "run", bucket_bytes, asynchronous), 2)
    for rank in range(2):
        saved = torch.load(tmp_path / f"run.rank{rank}", weights_only=True)
        for got, expected in zip(saved["got"], saved["expected"], strict=True):
            if expected is None:  # another process's to own
                assert got is None
                continue
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert torch.equal(got, expected)


def test_buckets_hold_one_kind_and_dtype_and_at_most_their_bytes(monkeypatch):
    """The split into buckets, by hand, without processes: in registration order per kind and dtype, a bucket
    closed when the next tensor would take it past BUCKET_BYTES received (here 100 B on 2 processes); a larger
    tensor alone."""
    exchange = Exchange()
    monkeypatch.setattr(Exchange, "BUCKET_BYTES", 100)
    floats = [torch.zeros(2, 5), torch.zeros(2, 5), torch.zeros(2, 30), torch.zeros(2, 2)]  # 80, 80, 480, 32 B on 2
    exchange.gather(floats[0])
    exchange.gather(torch.zeros(2, 3, dtype=torch.long))  # 96 B
    exchange.to_owners(torch.zeros(2, 6), 1, [(0, 3), (3, 6)])  # 48 B
    for x in floats[1:]:
        exchange.gather(x)
    # the floats' buckets closed as they fill, then the open ones in the order their kind and dtype came
    assert exchange._buckets(world=2, rank=0) == [("whole", [0]), ("whole", [3]), ("whole", [4]),
                                                  ("whole", [5]), ("whole", [1]), ("owned", [2])]
