"""What several processes would exchange per step for exact CD-GraB: the layer records (issue #47's (a)/(b)
inputs), the per-example gradients, or their sketches; bytes from the real models' shapes, and a timed gloo
all-gather of those sizes on 2 processes.

    OMP_NUM_THREADS=1 python bench/exact_exchange.py              # bench/results/exact-exchange-cpu.json
    python bench/exact_exchange.py --no-time                      # bytes only

Per model and per process, one step's b units (examples, or the engine's units):
- "records": what CDGraBSampler.step_units all-gathers (sorters/gather.py all_gather_units): every
  contribution of every recorded layer call, as the library keeps them (sorters/exact_products.py: Outer's
  left (b, T, R) and right (b, T, C), Rows' int64 ids (b, T) and values (b, T, C), Formed's (b, R, C)), plus
  the (b,) loss weights. MEASURED by recording one real forward and backward at the model's shape with
  sorters.exact.ExactGradients and adding the bytes of what it holds (b = 1, then times b: each record is
  per unit; b = 2 is checked to be twice b = 1). LSTM-Wiki2 cannot be recorded (its input is time-major
  and nn.LSTM has no layer rule): its records are counted from the same formulas (Rows of the embedding
  over the unit's tokens, Outer of the tied decoder, the LSTM's gradient formed per unit).
- "chosen": what all_gather_units actually sends: per parameter the smaller of its records and its
  gradient formed per unit (sorters.gather.exchange_bytes);
- "gradients": b * d float32, what CDGraBSampler.step all-gathers for exact CD-GraB today;
- "sketch": b * D float32, D = min(--sketch-dim, d) (sketched CD-GraB).
Each is bytes one process contributes to the all-gather; every process receives world_size times as much.
"collectives": one all-gather per record tensor, plus 3 small ones (all_gather_units makes fewer where it
sends a parameter formed).

Timing (--time, the default): 2 gloo processes on this machine (forked), an all-gather of one flat float32
tensor of each size, the median of --reps after one warm-up, sizes above --max-mib skipped. On one host
gloo copies through loopback TCP: the seconds say what the bytes cost relative to each other here, not on
a network. Writes ONE JSON object (with the commit) to --out and prints a markdown table.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere

FLOAT = 4


def record_bytes(model, losses_of, b: int) -> dict:
    """The layer records of b units (losses_of(b) -> (b,) per-unit losses): {"records": bytes of every
    record, "chosen": bytes all_gather_units sends (per parameter the smaller of records and formed,
    sorters.gather.exchange_bytes), "tensors": the record tensors, "d": d}."""
    from sorters.exact import ExactGradients
    from sorters.exact_products import Formed, Outer
    from sorters.gather import exchange_bytes

    exact = ExactGradients(model)
    units = exact(lambda: losses_of(b))
    out = {"records": units.scale.numel() * FLOAT, "chosen": units.scale.numel() * FLOAT, "tensors": 1, "d": exact.d}
    for p in exact.params:
        parts = [x for _, x in units.pieces.get(id(p), [])]
        for x in parts:
            held = [x.left, x.right] if isinstance(x, Outer) else [x.values] if isinstance(x, Formed) \
                else [x.ids, x.values]
            out["records"] += sum(t.numel() * t.element_size() for t in held)
            out["tensors"] += len(held)
        if parts:
            out["chosen"] += b * min(exchange_bytes(p, parts, [x.tokens for x in parts]))
    return out


def lr_hmda():
    model = torch.nn.Linear(25, 1)  # main-LR-HMDA.py: 25 features, d = 26
    x, y = torch.randn(8, 25), torch.randint(0, 2, (8,)).float()
    return model, lambda b: F.binary_cross_entropy_with_logits(model(x[:b]).squeeze(-1), y[:b], reduction="none")


def mlp_m4():
    from models.mlp import AutoregressiveMLP
    model = AutoregressiveMLP(20, 64, 3)  # main-MLP-M4.py's defaults: d = 5,569; 6 rollout steps an example
    x, y = torch.randn(8, 20), torch.randn(8, 6)
    return model, lambda b: (model(x[:b], 6) - y[:b]).square().mean(1)


def gpt2(n_embd: int, n_layer: int, n_head: int, tokens: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_positions=max(tokens, 128),
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (2, tokens))
    positions = torch.arange(tokens).expand(2, -1)  # (B, T): the position embedding sees the examples

    def losses(b):
        logits = model(input_ids=ids[:b], position_ids=positions[:b]).logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), ids[:b, 1:], reduction="none").mean(1)
    return model, losses


def lstm_records(b: int) -> dict:
    """LSTM-Wiki2 (models/lstm.py, V = 33,278, 32/32/2, tied): a unit is a chunk of 4 columns x 35 tokens,
    time-major. The tied matrix: Rows of the embedding (T int64 ids, T x 32 values) and Outer of the
    decoder (T x (32 + V)); the LSTM's 8 tensors have no rule: formed per unit."""
    from models.lstm import LSTMModel
    model = LSTMModel(33278)
    T, V, E = 4 * 35, 33278, 32
    rnn = sum(p.numel() for p in model.rnn.parameters()) * FLOAT
    tied = T * 8 + T * E * FLOAT + T * (E + V) * FLOAT
    return {"records": b * (FLOAT + tied + rnn), "chosen": b * (FLOAT + min(tied, V * E * FLOAT) + rnn),
            "tensors": 1 + 2 + 2 + 8, "d": sum(p.numel() for p in model.parameters())}


MODELS = {  # name: (per-process units b, what a unit is, builder or None)
    "LR-HMDA": (4, "an example (engine: 16 a step over 4 workers)", lr_hmda),
    "MLP-M4": (4, "a window (engine: 16 a step over 4 workers)", mlp_m4),
    "LSTM-Wiki2": (1, "a chunk of 4 columns x 35 tokens (engine: 1 a worker)", None),
    "GPT2-Wiki103": (1, "a block of 128 tokens (engine: 1 a worker, n_embd 128, 2 layers)",
                     lambda: gpt2(128, 2, 2, 128)),
    "GPT-2 small": (8, "a sequence of 128 tokens (the Trainer bench's 8 a step)", lambda: gpt2(768, 12, 12, 128)),
}


def sizes(sketch_dim: int) -> dict:
    out = {}
    for name, (b, unit, build) in MODELS.items():
        torch.manual_seed(0)
        if build is None:
            got, how = lstm_records(b), "formulas (no recording: time-major input, nn.LSTM formed per unit)"
        else:
            model, losses_of = build()
            got = record_bytes(model, losses_of, 1)
            two = record_bytes(model, losses_of, 2)
            assert two["records"] == 2 * got["records"] and two["chosen"] == 2 * got["chosen"], name  # per unit
            got = {**got, "records": b * got["records"], "chosen": b * got["chosen"]}
            how = "recorded"
            del model
        d = got["d"]
        D = min(sketch_dim, d)
        row = out[name] = {"units_per_process": b, "unit": unit, "d": d, "sketch_dim": D, "records_from": how,
                           "bytes": {"records": got["records"], "chosen": got["chosen"], "gradients": b * d * FLOAT,
                                     "sketch": b * D * FLOAT},
                           "collectives": got["tensors"] + 3}
        for key in ("records", "chosen"):
            row[f"{key}_vs_gradients"] = got[key] / (b * d * FLOAT)
            row[f"{key}_vs_sketch"] = got[key] / (b * D * FLOAT)
    return out


def gather_rank(rank: int, store: str, counts: list, reps: int, out: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    seconds = {}
    for n in counts:
        local = torch.ones(n // FLOAT)
        result = torch.empty(2 * local.numel())
        times = []
        for rep in range(reps + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather_into_tensor(result, local)
            times.append(time.perf_counter() - start)
        seconds[n] = statistics.median(times[1:])
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))


def time_gathers(byte_counts: list, reps: int) -> dict:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds.json")
        mp.start_processes(gather_rank, args=(os.path.join(tmp, "store"), byte_counts, reps, out), nprocs=2,
                           start_method="fork")
        return {int(k): v for k, v in json.loads(Path(out).read_text()).items()}


def markdown(result: dict) -> str:
    lines = ["| model | units b | d | records MB | chosen MB | gradients MB | sketch MB (D) | chosen / gradients | "
             "chosen / sketch | gather s: chosen | gradients | sketch |", "|" + "---|" * 12]
    for name, row in result["models"].items():
        mb = {k: v / 1e6 for k, v in row["bytes"].items()}
        t = row.get("gather_seconds", {})
        fmt = lambda key: "-" if t.get(key) is None else f"{t[key]:.4f}"  # noqa: E731
        lines.append(f"| {name} | {row['units_per_process']} | {row['d']:,} | {mb['records']:.4g} | "
                     f"{mb['chosen']:.4g} | {mb['gradients']:.4g} | {mb['sketch']:.4g} ({row['sketch_dim']}) | "
                     f"{row['chosen_vs_gradients']:.3g} | {row['chosen_vs_sketch']:.3g} | {fmt('chosen')} | "
                     f"{fmt('gradients')} | {fmt('sketch')} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sketch-dim", type=int, default=1024, help="D of the sketch column (the Trainer bench's)")
    parser.add_argument("--no-time", dest="time", action="store_false", help="bytes only, no gloo all-gather")
    parser.add_argument("--reps", type=int, default=5, help="timed all-gathers per size (after one warm-up)")
    parser.add_argument("--max-mib", type=float, default=1024.0,
                        help="sizes above this many MiB per process are not timed (memory: 3x per process)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "exact-exchange-cpu.json"),
                        help="where the JSON goes")
    args = parser.parse_args()
    from engine.runlog import git_commit, write_result

    models = sizes(args.sketch_dim)
    if args.time:
        wanted = sorted({n for row in models.values() for n in row["bytes"].values() if n <= args.max_mib * 2**20})
        seconds = time_gathers(wanted, args.reps)
        for row in models.values():
            row["gather_seconds"] = {key: seconds.get(n) for key, n in row["bytes"].items()}
    result = {"git_commit": git_commit(), "models": models,
              "settings": {"sketch_dim": args.sketch_dim, "bytes_per": "process and step (its share of the "
                           "all-gather; every process receives world_size times as much)", "timed": args.time,
                           "processes": 2, "backend": "gloo, one host", "reps": args.reps, "max_mib": args.max_mib,
                           "threads": torch.get_num_threads()}}
    write_result(args.out, result)
    print(markdown(result))


if __name__ == "__main__":
    main()
