"""GPT-2 small sharded with FSDP2 (fully_shard) on the CPU, 2 gloo processes (issue #61 goal 2): step time,
per-process peak memory and the bytes each process sends and receives per step, of a plain FSDP training step,
exact CD-GraB from the layer records (CDGraBSampler(exact=True)) by each records route, and the structured
sketch (LayerSketch + CDGraBSampler.step(sketches)), side by side in one run.

    OMP_NUM_THREADS=1 python bench/fsdp_gpt2_small.py        # bench/results/fsdp-gpt2-small-cpu.json
    python bench/fsdp_gpt2_small.py --small-config --tokens random --steps 2 --out /tmp/fsdp.json   # a smoke run

The model is models/gpt2.py's build_gpt2 at GPT-2 small's size (GPT2Config: 12 blocks, width 768, 12 heads,
1,024 positions, the 50,257-token vocabulary tied to the output layer; 124M parameters), randomly initialised
(nothing is downloaded), eager attention, dropout 0. Each process fully_shard-s every block, then the root (the
embeddings, ln_f and the tied lm_head), and trains on --batch sequences of --block tokens a step (its replica's
share of the step), AdamW, each example's loss the mean next-token cross-entropy over its sequence, the step's
loss their mean. Tokens: WikiText-103's validation split in GPT-2 BPE blocks (data/wikitext103.py, from
$CDGRAB_DATA; --tokens random: uniform random ids). Variants, each a fresh `python -m torch.distributed.run
--standalone --nproc_per_node 2` of this script's child mode (torch.set_num_threads(--threads) a process), so
that each process's peak resident memory (ru_maxrss at the end) is its variant's own:

- "plain": the FSDP training step alone (forward, backward: FSDP's all-gathers and reduce-scatter, AdamW);
- "exact records=owners", "exact records=all": the same step inside ExactGradients(model).recording(), then
  CDGraBSampler(exact=True).step_units (sorters/fsdp.py's ShardedRows: the running sum of this process's rows,
  the products over them, one all-reduce of the partials); records="owners" sends each process its own rows of
  each layer's row factor and the column factor whole, records="all" every unit's whole records (docs/fsdp.md);
- "exact records=owners-overlapped": records="owners" sent inside the backward, each parameter's records by
  asynchronous collectives as soon as its layers' output gradients are in (sorters.gather.OverlappedExchange),
  waited for in step_units; from the third step on (its first two steps exchange after the backward);
- "sketch D=<D>": the same step inside LayerSketch(model, D).recording(), then CDGraBSampler(d=D).step of the
  (batch, D) sketches (all-gathered).

Per process: the median over the steps after the second (after the first in a run of 2 steps; the same steps
in every variant: first-call allocations, and owners-overlapped exchanges after the backward in its first two) of
the step's wall seconds (zero_grad to optimizer.step, everything synchronous on gloo but the overlapped
exchange) and of its parts ("model": forward and backward, and within it "backward_exchange", the overlapped
exchange's calls in the backward, which start its collectives; "sorter": step_units / step, and within it
"gather" (all_gather_units), "products" (with their all-reduce), "update" (the running sum's); "agree_tokens":
the overlapped exchange's wait for the other processes' kinds and token counts of the records, in the backward
or in "gather"; "optimizer"); ru_maxrss at the end and the resident memory after the model
was sharded; and per step the bytes it sends and receives in every torch.distributed collective, counted by
wrapping torch.distributed's functions
(FSDP2 calls all_gather_single and reduce_scatter_single through them; the child checks that it did) and
sorters.gather's all-gather, split into "fsdp" (everything outside the sorter's call and the overlapped
exchange's calls) and "cdgrab" (inside them). Bytes are those of a direct exchange: an all-gather sends its
input to each other process and receives theirs; a reduce-scatter sends each other process its chunk of the
input and receives its own chunk from each; an all-reduce counts as a reduce-scatter and an all-gather
(2 (P - 1) / P of the tensor each way); an all-to-all sends and receives everything but its own block. Per
round a variant counts its slowest rank's step and its largest peak; per variant the median over the
interleaved rounds (every variant once a round), with the ratios to plain's. "cheaper_route": of "owners" and
"all", the route with the shorter sorter's part (the only part of the step those routes change; whole steps
vary more with the machine's load than the routes differ), with the shorter records' exchange ("gather") and
with fewer bytes received. "overlapped_vs_owners": owners-overlapped's step, model part, sorter's part and
bytes received over owners' (the overlapped exchange moves work from the sorter's part into the backward).
After every step (untimed) each process hands the heap that glibc keeps of freed tensors back to the system
(malloc_trim(0)), in every variant, so that a peak counts what a step holds rather than what glibc kept of the
steps before, which moved the same variant's peak by up to 350 MB between runs. Plain and the owners' route run
again without it ("plain, heap kept", "exact records=owners, heap kept", their ratios against each other): what
a training loop that never trims sees (--no-heap-kept leaves them out).
Writes ONE JSON object to --out (and prints it), then a markdown table.
"""
import argparse
import contextlib
import functools
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere

WORLD = 2  # processes
GPT2_SMALL = {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024}
SMALL = {"vocab_size": 1000, "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 128}  # --small-config
ROUTES = ("owners", "all", "owners-overlapped")
UNOVERLAPPED = ("owners", "all")  # the routes whose whole exchange is inside the sorter's call
TARGETS = {"step_vs_plain": 1.4, "peak_vs_plain": 1.15}  # issue #61 goal 2, for exact CD-GraB
PHASES = ("model", "backward_exchange", "agree_tokens", "sorter", "gather", "products", "update", "optimizer")


HEAP_KEPT = ", heap kept"  # a variant's name with it: glibc's freed heap not returned between steps


def variant_names(dim: int, sketch: bool = True, heap_kept: bool = True) -> list[str]:
    """The variants of a run, plain first; with heap_kept, plain and the owners' route again without the trim
    after each step."""
    names = ["plain"] + [f"exact records={route}" for route in ROUTES] + ([f"sketch D={dim}"] if sketch else [])
    return names + ([f"plain{HEAP_KEPT}", f"exact records=owners{HEAP_KEPT}"] if heap_kept else [])


def plain_of(name: str) -> str:
    """The plain variant a variant's ratios are taken against: the one trimmed as it is, or not."""
    return f"plain{HEAP_KEPT}" if name.endswith(HEAP_KEPT) else "plain"


def trim_heap() -> None:
    """Return the freed heap to the operating system (glibc's malloc_trim(0); nothing elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (looked up once: find_library runs ldconfig)."""
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "malloc_trim", None) if libc is not None else None


# ------------------------------------------------------------------------------------------- the bytes

def direct_bytes(name: str, call: dict, rank: int, world: int) -> tuple[int, int]:
    """(sent, received) bytes of one collective call in this process (the direct exchange of the module
    docstring); call: its bound arguments by name."""
    def size(t):
        return t.numel() * t.element_size()
    if name == "all_gather_single":
        return size(call["input_tensor"]) * (world - 1), size(call["output_tensor"]) - size(call["input_tensor"])
    if name == "reduce_scatter_single":
        return size(call["input"]) - size(call["output"]), size(call["output"]) * (world - 1)
    if name == "all_reduce":
        moved = size(call["tensor"]) * (world - 1) // world * 2
        return moved, moved
    if name == "all_to_all_single":
        out, inp = call["output"], call["input"]
        in_splits, out_splits = call["input_split_sizes"], call["output_split_sizes"]  # None: equal blocks
        own_in = in_splits[rank] * inp.element_size() if in_splits else size(inp) // world
        own_out = out_splits[rank] * out.element_size() if out_splits else size(out) // world
        return size(inp) - own_in, size(out) - own_out
    if name == "broadcast":
        mine = call["src"] == rank
        return (size(call["tensor"]) * (world - 1), 0) if mine else (0, size(call["tensor"]))
    if name == "gather":
        if call["dst"] == rank:
            return 0, size(call["tensor"]) * (world - 1)
        return size(call["tensor"]), 0
    raise ValueError(f"no byte rule for {name}")


class Traffic:
    """Counts every collective's bytes and calls in this process, by phase ("fsdp" unless inside `phase`)."""

    COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_to_all_single", "broadcast",
                   "gather")

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.current = rank, world, "fsdp"
        self.counts = {phase: {"sent": 0, "received": 0, "calls": {}} for phase in ("fsdp", "cdgrab")}

    @contextlib.contextmanager
    def phase(self, name: str):
        self.current = name
        try:
            yield
        finally:
            self.current = "fsdp"

    def wrap(self, name: str, collective):
        signature = inspect.signature(collective)

        def counted(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            sent, received = direct_bytes(name, bound.arguments, self.rank, self.world)
            entry = self.counts[self.current]
            entry["sent"] += sent
            entry["received"] += received
            entry["calls"][name] = entry["calls"].get(name, 0) + 1
            return collective(*args, **kwargs)
        return counted

    def install(self) -> None:
        """Wrap torch.distributed's collectives (FSDP2 and sorters call them through the module) and
        sorters.gather's all-gather (bound at import)."""
        import torch.distributed as dist

        import sorters.gather as gather
        for name in self.COLLECTIVES:
            setattr(dist, name, self.wrap(name, getattr(dist, name)))
        gather._all_gather_single = self.wrap("all_gather_single", gather._all_gather_single)


# ------------------------------------------------------------------------------------------- one process

class Clock:
    """Seconds of named parts of the current step (wrapped callables add their time to their part)."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}

    def timed(self, part: str, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.parts[part] = self.parts.get(part, 0.0) + time.perf_counter() - start
        return run

    @contextlib.contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - start


def rss_mb() -> float:
    """This process's resident memory now (MB), from /proc (ru_maxrss is the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(variant: str, args, tokens_file: str, folder: Path) -> None:
    """One torchrun process of a variant: its measurements to folder/rank<R>.json."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    import sorters.gather as gather
    import sorters.sampler as sampler_module
    from models.gpt2 import build_gpt2
    from sorters import CDGraBSampler, LayerSketch
    from sorters.exact import ExactGradients, UnitGradients
    from sorters.fsdp import ShardedRows

    trim = not variant.endswith(HEAP_KEPT)
    variant = variant.removesuffix(HEAP_KEPT)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    traffic, clock = Traffic(rank, world), Clock()
    traffic.install()
    torch.manual_seed(0)
    model = build_gpt2(**(SMALL if args.small_config else GPT2_SMALL))
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    rss_built = rss_mb()
    tokens = torch.load(tokens_file, weights_only=True)  # (examples, block) ids
    m = len(tokens)  # one epoch: every example once, --steps steps of --batch per process
    exact = sketcher = sampler = None
    if variant.startswith("exact"):
        exact = ExactGradients(model)  # after fully_shard: the sharded parameters
        ShardedRows.RECORDS = variant.split("=")[1]  # the route of the share the sampler installs (this process)
        sampler = CDGraBSampler(m, batch_size=args.batch, d=exact.d, seed=0, exact=True)
        sampler_module.all_gather_units = clock.timed("gather", sampler_module.all_gather_units)
        UnitGradients.products = clock.timed("products", UnitGradients.products)
        UnitGradients.add_to = clock.timed("update", UnitGradients.add_to)
        started = clock.timed("backward_exchange", gather.OverlappedExchange.layer_done)  # (owners-overlapped only)

        def layer_done(*args, **kwargs):  # its collectives are CD-GraB's, though they run inside the backward
            with traffic.phase("cdgrab"):
                return started(*args, **kwargs)
        gather.OverlappedExchange.layer_done = layer_done
        gather._longest_tokens = clock.timed("agree_tokens", gather._longest_tokens)
    elif variant.startswith("sketch"):
        sketcher = LayerSketch(model, args.dim, seed=0)  # after fully_shard
        sampler = CDGraBSampler(m, batch_size=args.batch, d=sketcher.dim, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    indices = list(sampler) if sampler is not None else list(range(rank * args.batch * args.steps,
                                                                    (rank + 1) * args.batch * args.steps))

    def losses_of(x):  # (B,) each sequence's mean next-token cross-entropy
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none").mean(1)

    steps, parts = [], []
    for t in range(args.steps):
        x = tokens[indices[t * args.batch:(t + 1) * args.batch]]
        clock.parts = {}
        start = time.perf_counter()
        optimizer.zero_grad()
        with clock.part("model"):
            if exact is not None or sketcher is not None:
                with (exact or sketcher).recording() as rec:
                    losses = losses_of(x)
                    rec.watch(losses)
            else:
                losses = losses_of(x)
            losses.mean().backward()
        if sampler is not None:
            with clock.part("sorter"), traffic.phase("cdgrab"):
                if exact is not None:
                    sampler.step_units(rec.units())
                else:
                    sampler.step(rec.sketches())
        with clock.part("optimizer"):
            optimizer.step()
        steps.append(time.perf_counter() - start)
        parts.append(dict(clock.parts))
        if trim:  # (untimed) the step's freed heap back to the system, so the peak counts what a step holds
            trim_heap()
    if not traffic.counts["fsdp"]["calls"].get("all_gather_single") or \
            not traffic.counts["fsdp"]["calls"].get("reduce_scatter_single"):
        sys.exit("bench: FSDP2's all-gathers and reduce-scatters did not go through torch.distributed's functions "
                 "(the byte counts would miss them)")
    share = getattr(getattr(sampler, "sorter", None), "share", None)
    # the steps timed, the same in every variant: after the first two (first-call allocations; owners-overlapped's
    # first two exchange after the backward: the sampler installs the exchange at the first, the second's backward
    # learns which layer records which parameter); after the first only in a run of 2 steps
    warm = min(2, len(steps) - 1)
    result = {
        "rank": rank, "steps": len(steps), "timed_from_step": warm, "step_seconds": statistics.median(steps[warm:]),
        "steps_seconds": steps,
        "part_seconds": {part: statistics.median(p.get(part, 0.0) for p in parts[warm:]) for part in PHASES
                         if any(part in p for p in parts)},
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_after_sharding_mb": rss_built,
        "bytes_per_step": {phase: {"sent": c["sent"] / len(steps), "received": c["received"] / len(steps)}
                           for phase, c in traffic.counts.items()},
        "calls_per_step": {phase: {name: n / len(steps) for name, n in c["calls"].items()}
                           for phase, c in traffic.counts.items()},
        "d": sum(p.numel() for p in model.parameters()),
        "running_sum_numel": None if share is None else sampler.sorter.running_sum.numel(),
        "records": getattr(share, "records", None),
        "next_orders": None if sampler is None else sampler.sorter.next_orders.tolist(),
    }
    dist.destroy_process_group()
    (folder / f"rank{rank}.json").write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------- the runs

def run_variant(name: str, args, tokens_file: str) -> list[dict]:
    """Every process's measurements of one run of a variant, rank 0's first; exits with the child's error."""
    with tempfile.TemporaryDirectory() as folder:
        child_args = [__file__, "--child", name, "--child-out", folder, "--tokens-file", tokens_file,
                      "--steps", str(args.steps), "--batch", str(args.batch), "--dim", str(args.dim),
                      "--threads", str(args.threads)] + (["--small-config"] if args.small_config else [])
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}"]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        done = subprocess.run([sys.executable, *launch, *child_args], capture_output=True, text=True, cwd=REPO,
                              env=env)
        files = [Path(folder) / f"rank{rank}.json" for rank in range(WORLD)]
        if done.returncode or not all(f.is_file() for f in files):
            sys.exit(f"{name} failed:\n{(done.stderr + done.stdout)[-3000:]}")
        return [json.loads(f.read_text()) for f in files]


def over_ranks(ranks: list[dict]) -> dict:
    """One run of a variant: its slowest rank's step and parts (the others wait for it in the collectives), its
    largest peak, the largest bytes each way; every rank's own numbers in "ranks"."""
    parts = {part for r in ranks for part in r["part_seconds"]}
    return {"step_seconds": max(r["step_seconds"] for r in ranks),
            "part_seconds": {part: max(r["part_seconds"].get(part, 0.0) for r in ranks) for part in sorted(parts)},
            "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
            "bytes_per_step": {phase: {way: max(r["bytes_per_step"][phase][way] for r in ranks)
                                       for way in ("sent", "received")} for phase in ("fsdp", "cdgrab")},
            "ranks": ranks}


def summarise(rounds: dict) -> dict:
    """Per variant the medians over rounds, the ratios to plain's, and CD-GraB's bytes against FSDP's own."""
    def median(name, get):
        return statistics.median(get(run) for run in rounds[name])

    summary = {}
    for name in rounds:
        plain_step = median(plain_of(name), lambda run: run["step_seconds"])
        plain_peak = median(plain_of(name), lambda run: run["peak_rss_mb"])
        step, peak = median(name, lambda run: run["step_seconds"]), median(name, lambda run: run["peak_rss_mb"])
        parts = sorted({part for run in rounds[name] for part in run["part_seconds"]})
        moved = {phase: {way: median(name, lambda run, p=phase, w=way: run["bytes_per_step"][p][w])
                         for way in ("sent", "received")} for phase in ("fsdp", "cdgrab")}
        summary[name] = {
            "step_seconds": round(step, 3), "step_vs_plain": round(step / plain_step, 3),
            "peak_rss_mb": round(peak, 1), "peak_vs_plain": round(peak / plain_peak, 3),
            "part_seconds": {part: round(median(name, lambda run, p=part: run["part_seconds"].get(p, 0.0)), 3)
                             for part in parts},
            "bytes_per_step": moved,
            "cdgrab_bytes_vs_fsdp": {way: round(moved["cdgrab"][way] / moved["fsdp"][way], 4)
                                     for way in ("sent", "received")},
            "rounds": rounds[name]}
    return summary


def orders_equal(rounds: dict) -> bool | None:
    """Whether every records route ends every round with the same next-epoch orders on every rank as the first
    route (the same products: routing moves bytes, not numbers); None when a route was left out."""
    names = [f"exact records={route}" for route in ROUTES]
    if not all(name in rounds for name in names):
        return None
    return all(a["next_orders"] == b["next_orders"] for runs in zip(*(rounds[name] for name in names))
               for other in runs[1:] for a, b in zip(runs[0]["ranks"], other["ranks"]))


def markdown(result: dict) -> str:
    lines = ["| variant | step s | vs plain | peak RSS MB | vs plain | FSDP sent MB / step | CD-GraB sent MB / step "
             "| CD-GraB received MB / step |", "|---|---|---|---|---|---|---|---|"]
    for name, v in result["variants"].items():
        b = v["bytes_per_step"]
        lines.append(f"| {name} | {v['step_seconds']:.2f} | {v['step_vs_plain']:.2f} | {v['peak_rss_mb']:.0f} | "
                     f"{v['peak_vs_plain']:.2f} | {b['fsdp']['sent'] / 1e6:.4g} | {b['cdgrab']['sent'] / 1e6:.4g} | "
                     f"{b['cdgrab']['received'] / 1e6:.4g} |")
    return "\n".join(lines)


def prepare_tokens(args, path: Path) -> str:
    """The run's examples, (WORLD * steps * batch, block) ids, saved to path; where they come from."""
    import torch
    rows = WORLD * args.steps * args.batch
    vocab = (SMALL if args.small_config else GPT2_SMALL)["vocab_size"]
    if args.tokens == "random":
        ids = torch.randint(0, vocab, (rows, args.block), generator=torch.Generator().manual_seed(1))
        source = f"uniform random ids below {vocab}"
    else:
        from common.errors import UserFacingError
        from data.wikitext103 import load_blocks
        data = os.environ.get("CDGRAB_DATA", str(REPO / "datasets"))
        try:
            blocks = load_blocks(data, "valid", args.block)
        except UserFacingError as error:
            sys.exit(f"bench: {error} (or pass --tokens random)")
        if len(blocks) < rows:
            sys.exit(f"bench: WikiText-103's validation split has {len(blocks)} blocks of {args.block} tokens, fewer "
                     f"than the {rows} a run takes; lower --steps or --batch")
        ids = blocks[:rows] % vocab  # (--small-config: its smaller vocabulary)
        source = f"WikiText-103 validation split, GPT-2 BPE, the first {rows} blocks of {args.block} tokens" + \
            (f", ids mod {vocab}" if args.small_config else "")
    torch.save(ids, path)
    return source


def measure(args) -> dict:
    """Every variant once per round, interleaved; the result object (without the commit)."""
    import torch
    load_before = os.getloadavg()
    names = variant_names(args.dim, not args.no_sketch, not args.no_heap_kept)
    rounds: dict = {}
    with tempfile.TemporaryDirectory() as folder:
        tokens_file = str(Path(folder) / "tokens.pt")
        source = prepare_tokens(args, Path(tokens_file))
        for round_ in range(args.rounds):
            for name in names:
                rounds.setdefault(name, []).append(over_ranks(run_variant(name, args, tokens_file)))
                print(f"round {round_ + 1} {name}: step {rounds[name][-1]['step_seconds']:.2f} s, peak "
                      f"{rounds[name][-1]['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
    summary = summarise(rounds)
    first = summary["plain"]["rounds"][0]["ranks"][0]
    exact_names = [name for name in names if name.startswith("exact") and not name.endswith(HEAP_KEPT)]

    def cheapest(cost):  # the unoverlapped route with the smallest cost
        return min(UNOVERLAPPED, key=lambda route: cost(summary[f"exact records={route}"]))

    def overlapped_vs_owners(get):  # owners-overlapped's cost over owners'
        owners, overlapped = (get(summary[f"exact records={route}"]) for route in ("owners", "owners-overlapped"))
        return round(overlapped / owners, 3) if owners else None
    overlap = {"step_seconds": overlapped_vs_owners(lambda v: v["step_seconds"]),
               "model_seconds": overlapped_vs_owners(lambda v: v["part_seconds"].get("model", 0.0)),
               "sorter_seconds": overlapped_vs_owners(lambda v: v["part_seconds"].get("sorter", 0.0)),
               "cdgrab_bytes_received": overlapped_vs_owners(lambda v: v["bytes_per_step"]["cdgrab"]["received"])}
    return {
        "variants": summary,
        "targets": {"exact": TARGETS, "met": {name: {key: summary[name][key] <= limit for key, limit in TARGETS.items()}
                                             for name in exact_names}},
        "cheaper_route": {"sorter_seconds": cheapest(lambda v: v["part_seconds"].get("sorter", 0.0)),
                          "gather_seconds": cheapest(lambda v: v["part_seconds"].get("gather", 0.0)),
                          "bytes_received": cheapest(lambda v: v["bytes_per_step"]["cdgrab"]["received"])},
        "overlapped_vs_owners": overlap,
        "routes_give_the_same_orders": orders_equal(rounds),
        "settings": {
            "model": f"models.gpt2.build_gpt2(**{SMALL if args.small_config else GPT2_SMALL}): eager attention, "
                     "dropout 0, random init, lm_head tied to wte",
            "d": first["d"], "processes": WORLD, "sharding": "fully_shard of every block, then the root",
            "launch": f"torch.distributed.run --standalone --nproc_per_node {WORLD}, gloo",
            "batch_per_process": args.batch, "block": args.block, "steps_per_run": args.steps,
            "rounds": args.rounds, "threads_per_process": args.threads, "sketch_dim": args.dim,
            "optimizer": "AdamW", "tokens": source,
            "statistic": "per rank the median over steps (first two dropped); per run the max over ranks; then the "
                         "median over rounds",
            "peak": "ru_maxrss of each fresh process at the end of training",
            "heap": "after every step (untimed) each process returns glibc's freed heap to the system "
                    "(malloc_trim(0)), in every variant but those named '<variant>, heap kept' (ratios against "
                    "'plain, heap kept')",
            "bytes": "per step and process, a direct exchange (module docstring); fsdp: outside the sorter's call, "
                     "cdgrab: inside step_units / step and the overlapped exchange's calls in the backward",
            "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "load_average_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4,
                        help="steps per run, one epoch (the first two are not timed; the first only, of 2)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per process and step")
    parser.add_argument("--block", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions of every variant")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    parser.add_argument("--dim", type=int, default=1024, help="sketch dimension D of the sketch variant")
    parser.add_argument("--no-sketch", action="store_true", help="leave out the structured sketch")
    parser.add_argument("--no-heap-kept", action="store_true",
                        help="leave out plain and the owners' route run without the trim after each step")
    parser.add_argument("--tokens", choices=("wikitext103", "random"), default="wikitext103",
                        help="WikiText-103's validation split from $CDGRAB_DATA, or random ids")
    parser.add_argument("--small-config", action="store_true", help=f"build_gpt2(**{SMALL}) instead of GPT-2 small")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "fsdp-gpt2-small-cpu.json"),
                        help="the JSON file to write")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the variant of one torchrun process
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)  # the folder its ranks write to
    parser.add_argument("--tokens-file", default=None, help=argparse.SUPPRESS)  # the examples, saved by the parent
    args = parser.parse_args()
    if args.steps < 2 or min(args.batch, args.block, args.rounds, args.threads, args.dim) < 1:
        parser.error("--steps must be >= 2 (the first is not timed); --batch, --block, --rounds, --threads and "
                     "--dim >= 1")
    if args.block < 2:
        parser.error("--block must be >= 2 (a next-token loss needs two tokens)")
    if args.child:
        child(args.child, args, args.tokens_file, Path(args.child_out))
        return
    if Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a folder; give the JSON file's path")
    from engine.runlog import git_commit, write_result

    commit = git_commit()  # when the run starts: the code the children import ("-dirty" if it differs)
    result = {"git_commit": commit, **measure(args)}
    write_result(args.out, result)
    print(markdown(result))


if __name__ == "__main__":
    main()
