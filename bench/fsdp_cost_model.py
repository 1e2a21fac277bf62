"""A cost model on paper of exact CD-GraB under FSDP2 (issue #61 goal 4; docs/fsdp.md, "The cost at scale"):
the running sum's memory per process, the bytes each process sends per step against FSDP's own all-gathers
and reduce-scatters, and the time those bytes and CD-GraB's extra arithmetic take against the step's compute.

    python bench/fsdp_cost_model.py          # bench/results/fsdp-cost-model.json, and a markdown table

Two uses, one set of formulas:
- "check": GPT-2 small on 2 processes at the settings of bench/results/fsdp-gpt2-small-cpu.json. The model's
  bytes per step, FSDP's and CD-GraB's by each records route, beside what that bench measured (its collectives
  counted one by one); they agree where the formulas cover the same traffic (the model leaves out the few
  integers of the records' shapes and the products' one all-reduce, and says how large they are).
- "scale": a 7B Llama-2-shaped model (32 blocks of width 4,096, MLP 11,008, vocabulary 32,000, untied
  embeddings) on 64 GPUs (8 nodes of 8), a few settings of tokens per example and examples per GPU.

The formulas follow the library (docs/fsdp.md, "What crosses the wire"): FSDP2 all-gathers each block's
parameters in the forward and again in the backward (the root's once: it keeps them after its forward) and
reduce-scatters the gradients; per process and step, a "direct exchange" counts what a process sends to the
others (an all-gather: its input to each of the P - 1 others; a reduce-scatter or an all-to-all: every block
but its own). Exact CD-GraB's records of U examples a process, T tokens each, per parameter (R rows, C columns):
a Linear's (or Conv1D's) records are T (R + C) numbers an example (the row factor: R of them a token), an
embedding's T ids and T x C values, a vector's (a bias, a norm's weight) R numbers; a parameter's records go
formed (R x C numbers an example) when those are fewer than its records (sorters.gather.exchange_bytes's rule).
Route "all": every process all-gathers every record, the choice made on the whole sizes. Route "owners" (the
default): the row factor (or a formed gradient's rows, or a vector) by one all-to-all, each process receiving
only its rows (torch.chunk's split: ceil(R / P) a process), the column factor and an embedding's records by an
all-gather; the choice made on that route's own bytes (T (ceil(R / P) + C) against ceil(R / P) x C an example).

Time: bytes / link bandwidth (each process's link, one direction: the bytes a process sends cross it), and
floating-point operations / sustained rate. The step's compute is 6 (forward 2, backward 4) multiply-adds of
every matrix per token, plus attention's 12 L T^2 h per example (forward and backward). CD-GraB's own arithmetic,
either route: each example's gradient of each matrix, formed (2 T R C) or streamed against the running sum's rows
(the n = P U examples' 2 T (R / P) C on each of the P processes: the same total), the products over a process's
rows (<S, g_u> and <g_u, g_v>: 2 (n + n^2) d / P) and the running sum's update: 2 n d / P of formed gradients,
and for a matrix whose records are streamed one product over the n examples' tokens again (2 T (R / P) C each: a
sharded process keeps no per-parameter sum of the examples, which would spare half of it for d / P more
memory). A plain FSDP step
takes the longer of its compute and its wire (FSDP overlaps them); an exact CD-GraB step adds its arithmetic and
its wire to that (nothing of it overlapped): "step_vs_plain". Nothing here is measured; the assumptions are in
the JSON.
"""
import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere

FLOAT32, ID = 4, 8  # bytes of a float32 record or running-sum entry, of an int64 token id

# ------------------------------------------------------------------------------------- the models' shapes


def gpt2_parameters(vocab: int, width: int, blocks: int, positions: int) -> list[dict]:
    """GPT-2's parameters in transformers' layout, the lm_head tied to wte: per parameter its name, rows R and
    columns C (a vector: C = 1), its kind ("matrix": records T (R + C) an example; "embedding"; "vector"), whether
    FSDP regathers it in the backward (the blocks; not the root's), and for wte the lm_head's matrix records too."""
    def vector(name, n, block=True):
        return {"name": name, "R": n, "C": 1, "kinds": ["vector"], "regathered": block}

    def matrix(name, rows, cols):  # Conv1D (in, out): its rows are the input's, its records T (in + out)
        return {"name": name, "R": rows, "C": cols, "kinds": ["matrix"], "regathered": True}
    params = [{"name": "wte", "R": vocab, "C": width, "kinds": ["embedding", "matrix"], "regathered": False},
              {"name": "wpe", "R": positions, "C": width, "kinds": ["embedding"], "regathered": False}]
    for b in range(blocks):
        h = f"h.{b}."
        params += [vector(h + "ln_1.weight", width), vector(h + "ln_1.bias", width),
                   matrix(h + "attn.c_attn.weight", width, 3 * width), vector(h + "attn.c_attn.bias", 3 * width),
                   matrix(h + "attn.c_proj.weight", width, width), vector(h + "attn.c_proj.bias", width),
                   vector(h + "ln_2.weight", width), vector(h + "ln_2.bias", width),
                   matrix(h + "mlp.c_fc.weight", width, 4 * width), vector(h + "mlp.c_fc.bias", 4 * width),
                   matrix(h + "mlp.c_proj.weight", 4 * width, width), vector(h + "mlp.c_proj.bias", width)]
    return params + [vector("ln_f.weight", width, False), vector("ln_f.bias", width, False)]


def llama_parameters(vocab: int, width: int, blocks: int, mlp: int) -> list[dict]:
    """A Llama-2-shaped model: untied embedding and output layer, 4 attention and 3 MLP Linears (no biases) and
    2 norms a block, a final norm. The embedding, final norm and output layer belong to the root."""
    def linear(name, out, inp):
        return {"name": name, "R": out, "C": inp, "kinds": ["matrix"], "regathered": True}
    params = [{"name": "embed_tokens", "R": vocab, "C": width, "kinds": ["embedding"], "regathered": False}]
    for b in range(blocks):
        h = f"layers.{b}."
        params += [{"name": h + "input_layernorm", "R": width, "C": 1, "kinds": ["vector"], "regathered": True}]
        params += [linear(h + f"self_attn.{x}_proj", width, width) for x in "qkvo"]
        params += [{"name": h + "post_attention_layernorm", "R": width, "C": 1, "kinds": ["vector"],
                    "regathered": True}]
        params += [linear(h + "mlp.gate_proj", mlp, width), linear(h + "mlp.up_proj", mlp, width),
                   linear(h + "mlp.down_proj", width, mlp)]
    return params + [{"name": "norm", "R": width, "C": 1, "kinds": ["vector"], "regathered": False},
                     {"name": "lm_head", "R": vocab, "C": width, "kinds": ["matrix"], "regathered": False}]


# ------------------------------------------------------------------------------------------------ bytes

def chunk(R: int, P: int, rank: int) -> int:
    """Rows of R that process `rank` of P holds (torch.chunk's split, as fully_shard's)."""
    size = math.ceil(R / P)
    return max(0, min(R, (rank + 1) * size) - min(R, rank * size))


def fsdp_bytes(params: list[dict], P: int, rank: int, gather_bytes: int, reduce_bytes: int) -> int:
    """Bytes one process sends per step in FSDP2's own collectives: its shard of every parameter to each other
    process in each all-gather (blocks twice, the root once), and every other process's shard of the
    gradients in the reduce-scatter."""
    sent = 0
    for p in params:
        numel, mine = p["R"] * p["C"], chunk(p["R"], P, rank) * p["C"]
        sent += mine * (P - 1) * gather_bytes * (2 if p["regathered"] else 1)
        sent += (numel - mine) * reduce_bytes
    return sent


def records_per_example(p: dict, T: int) -> int:
    """The library's rule's records size of one example (bytes): T (R + C) a matrix, T ids and T x C values an
    embedding, R a vector; summed over the parameter's kinds (a tied wte: its embedding and output layer)."""
    size = 0
    for kind in p["kinds"]:
        size += {"matrix": T * (p["R"] + p["C"]) * FLOAT32, "embedding": T * (ID + p["C"] * FLOAT32),
                 "vector": p["R"] * FLOAT32}[kind]
    return size


def goes_formed(p: dict, P: int, T: int, route: str) -> bool:
    """Whether the library sends parameter p's gradient formed per example rather than its records: the smaller,
    on route "owners" weighed on that route's own bytes (sorters.gather.exchange_bytes(rows=)); a vector never."""
    R, C = p["R"], p["C"]
    if route == "owners":
        mine = math.ceil(R / P)
        records = sum({"matrix": T * (mine + C) * FLOAT32, "embedding": T * (ID + C * FLOAT32),
                       "vector": mine * FLOAT32}[kind] for kind in p["kinds"])
        return mine * C * FLOAT32 < records and p["kinds"] != ["vector"]
    return R * C * FLOAT32 < records_per_example(p, T) and p["kinds"] != ["vector"]


def cdgrab_bytes(params: list[dict], P: int, rank: int, U: int, T: int, route: str) -> tuple[int, int]:
    """(bytes one process sends per step in exact CD-GraB's records exchange, the float32 entries of the
    gradients it forms per example), U examples a process of T tokens; route "all" or "owners"."""
    sent = formed_entries = 0
    for p in params:
        R, C = p["R"], p["C"]
        rows_sent = R - chunk(R, P, rank)  # an all-to-all of rows: all but this process's own
        if goes_formed(p, P, T, route):
            formed_entries += R * C
            sent += U * (rows_sent * C if route != "all" else R * C * (P - 1)) * FLOAT32
            continue
        for kind in p["kinds"]:
            if kind == "embedding":
                sent += U * T * (ID + C * FLOAT32) * (P - 1)
            elif kind == "vector":
                sent += U * (rows_sent if route != "all" else R * (P - 1)) * FLOAT32
            elif route == "all":
                sent += U * T * (R + C) * FLOAT32 * (P - 1)
            else:  # the row factor's rows to their owners, the column factor to everyone
                sent += U * T * (rows_sent + C * (P - 1)) * FLOAT32
    return sent, formed_entries


# ---------------------------------------------------------------------------------------------- the uses

def check(bench: dict) -> dict:
    """The model at bench/results/fsdp-gpt2-small-cpu.json's settings, beside its measured bytes per step."""
    s = bench["settings"]
    P, U, T = s["processes"], s["batch_per_process"], s["block"]
    params = gpt2_parameters(50257, 768, 12, 1024)
    rows = {}
    for rank in range(P):
        measured = {r["rank"]: r for r in bench["variants"]["plain"]["rounds"][0]["ranks"]}[rank]
        row = {"fsdp": {"model": fsdp_bytes(params, P, rank, FLOAT32, FLOAT32),
                        "measured": measured["bytes_per_step"]["fsdp"]["sent"]}}
        for route in ("owners", "all"):
            ranks = bench["variants"][f"exact records={route}"]["rounds"][0]["ranks"]
            got = {r["rank"]: r for r in ranks}[rank]["bytes_per_step"]["cdgrab"]["sent"]
            row[f"cdgrab records={route}"] = {"model": cdgrab_bytes(params, P, rank, U, T, route)[0], "measured": got}
        for entry in row.values():
            entry["model_vs_measured"] = round(entry["model"] / entry["measured"], 6)
        rows[f"rank {rank}"] = row
    return {"settings": {"model": "GPT-2 small (tied)", "processes": P, "examples_per_process": U, "tokens": T,
                         "bench": "bench/results/fsdp-gpt2-small-cpu.json", "bench_commit": bench["git_commit"]},
            "bytes_sent_per_step": rows}


def scale(P: int, link_gb_s: float, tflop_s: float, settings: list[tuple[int, int]]) -> list[dict]:
    """The 7B model on P GPUs: per (T tokens an example, U examples a GPU and step) and route, S's memory,
    bytes, and times against the step's compute."""
    width, blocks, mlp, vocab = 4096, 32, 11008, 32000
    params = llama_parameters(vocab, width, blocks, mlp)
    d = sum(p["R"] * p["C"] for p in params)
    matrices = sum(p["R"] * p["C"] for p in params if p["name"] != "embed_tokens")  # the ones a token multiplies
    out = []
    for T, U in settings:
        step_flops = 6 * U * T * matrices + 12 * blocks * T * T * width * U
        fsdp = fsdp_bytes(params, P, 0, 2, 4)  # bf16 all-gathers (MixedPrecisionPolicy), float32 reduce-scatter
        row = {"tokens": T, "examples_per_gpu": U, "d": d,
               "running_sum_gb_per_gpu": round(d / P * FLOAT32 / 1e9, 3),
               "fsdp_sharded_state_gb_per_gpu": round(d / P * 16 / 1e9, 3),  # fp32 params, grads, Adam's 2
               "step_compute_s": round(step_flops / (tflop_s * 1e12), 3),
               "fsdp_gb_sent": round(fsdp / 1e9, 2), "fsdp_wire_s": round(fsdp / (link_gb_s * 1e9), 3),
               "routes": {}}
        plain = max(step_flops / (tflop_s * 1e12), fsdp / (link_gb_s * 1e9))  # FSDP overlaps its wire
        n = P * U
        for route in ("all", "owners"):
            sent, formed = cdgrab_bytes(params, P, 0, U, T, route)
            # each example's gradient of every matrix, formed by its process or streamed by the rows' owners; the
            # products; the update: a formed gradient's rows times the n signs, a streamed matrix's one product over
            # the n examples' tokens again (no per-parameter sum of the examples is kept under sharding)
            streamed = sum(p["R"] * p["C"] for p in params if p["kinds"] == ["matrix"] and not goes_formed(p, P, T, route))
            update = 2 * n * (d - streamed) / P + 2 * n * T * streamed / P
            flops = 2 * T * matrices * U + 2 * (n + n * n) * d / P + update
            wire, compute = sent / (link_gb_s * 1e9), flops / (tflop_s * 1e12)
            row["routes"][route] = {"gb_sent": round(sent / 1e9, 2), "vs_fsdp_bytes": round(sent / fsdp, 3),
                                    "wire_s": round(wire, 3), "compute_s": round(compute, 3),
                                    "formed_share_of_d": round(formed / d, 3),
                                    "step_vs_plain": round((plain + wire + compute) / plain, 2)}
        out.append(row)
    return out


def markdown(result: dict) -> str:
    lines = ["| 7B, 64 GPUs: T x U | S GB/GPU | step compute s | FSDP GB sent (s) | route | CD-GraB GB sent "
             "(x FSDP) | wire s | extra compute s | step vs plain |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["scale"]:
        for route, r in row["routes"].items():
            lines.append(f"| {row['tokens']} x {row['examples_per_gpu']} | {row['running_sum_gb_per_gpu']} | "
                         f"{row['step_compute_s']} | {row['fsdp_gb_sent']} ({row['fsdp_wire_s']}) | {route} | "
                         f"{r['gb_sent']} ({r['vs_fsdp_bytes']}) | {r['wire_s']} | {r['compute_s']} | "
                         f"{r['step_vs_plain']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=64, help="processes P of the 7B model (default 64)")
    parser.add_argument("--link-gb-s", type=float, default=50.0,
                        help="bytes a GPU sends per second, GB/s (default 50: 400 Gb/s InfiniBand a GPU)")
    parser.add_argument("--tflop-s", type=float, default=400.0,
                        help="sustained bf16 TFLOP/s a GPU (default 400: about 40%% of an H100's dense peak)")
    parser.add_argument("--bench", default=str(REPO / "bench" / "results" / "fsdp-gpt2-small-cpu.json"),
                        help="the measured 2-process bench the model is checked against")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "fsdp-cost-model.json"),
                        help="where the JSON goes")
    args = parser.parse_args()
    if args.gpus < 2 or args.link_gb_s <= 0 or args.tflop_s <= 0:
        parser.error("--gpus must be >= 2, --link-gb-s and --tflop-s > 0")
    try:
        bench = json.loads(Path(args.bench).read_text())
    except (OSError, ValueError) as error:
        parser.error(f"--bench: cannot read {args.bench} ({error}); run bench/fsdp_gpt2_small.py first")
    from engine.runlog import git_commit
    result = {"git_commit": git_commit(),
              "assumptions": {"gpus": args.gpus, "link_gb_s": args.link_gb_s, "tflop_s": args.tflop_s,
                              "fsdp": "bf16 all-gathers, float32 reduce-scatter, the blocks regathered in the "
                                      "backward", "records": "float32 (upcast to the parameters' dtype)"},
              "check": check(bench),
              "scale": scale(args.gpus, args.link_gb_s, args.tflop_s, [(1024, 4), (4096, 1), (4096, 4)])}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["check"], indent=1))
    print(markdown(result))


if __name__ == "__main__":
    main()
