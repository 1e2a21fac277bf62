"""Operators dispatched per training step, counted on the CPU: a proxy for a GPU's kernel launches
(issue #62, goal 1).

    python bench/dispatch_count.py [--data-dir DIR] [--benchmarks NAME ...] [--gpt2-max-seq-length T] [--json PATH]

Counts are deterministic (unlike times), so the machine's load does not change them.

How it counts: a `torch.utils._python_dispatch.TorchDispatchMode` (`OpCounter`) sees every ATen
operator after autograd and after implicit composites (CompositeImplicitAutograd) have been
decomposed, in forward and backward alike: the calls a device backend would get, which is what
launches kernels on a GPU. torch.profiler
was not chosen: on the CPU it records composite operators and their children nested (aten::linear over
aten::t over aten::transpose ...), so its counts need a tree walk to mean anything, and it lists no
launches without CUDA. The counter splits what it sees into
- dispatched: every operator call;
- kernel ops: calls that do work on tensor data, i.e. all but views (the operator's schema says it
  returns an alias), the calls that only allocate or read metadata (NO_KERNEL) and the profiler's
  range markers. This is the GPU proxy. It undercounts: an operator registered as one composite with
  its own derivative (CompositeExplicitAutograd, e.g. binary_cross_entropy_with_logits) counts once,
  though it calls several kernels (the mode is off while it handles a call), and one operator can be
  several CUDA kernels (cuBLAS's float64 addmv adds a splitKreduce).

Runs, per benchmark (its paper settings, as bench/gpu_epochs.py builds them, cut to a few steps per
epoch with --max-train-examples; one evaluation example, since evaluation is not counted; GPT-2 in
blocks of --gpt2-max-seq-length tokens, 32 by default: the operators of a step do not depend on the
block length, only their tensors' sizes, and the bench says so in its JSON's flags_beside_paper_settings;
GPT-2's gradients in one pass per step, `--grad-chunk all`, as a GPU computes them):
- textbook: bench/gpu_epochs.py's textbook loop of the same model, batches and optimizer, no sorter;
  torch.optim with its CPU default (a loop over the parameters) and, as "textbook foreach", with the
  multi-tensor (_foreach) kernels torch takes by default on CUDA;
- D-RR and CD-GraB: `engine.train.train` in this process, its first epoch counted from its start to
  its last step; CD-GraB with the CPU's sign loop (numba: its work is invisible to the counter) and as
  "CD-GraB gram" with the paths a GPU takes: `--sign-loop gram`, and per-unit products and token sums written
  straight into their gradient columns (engine.functional.PRODUCTS_INTO_SLOTS, off on the CPU, where a
  product into strided views is slow); all with `--overlap off` (the counter
  sees its own thread only; overlap moves the same sorter operators to a background thread).
Each run is counted twice, over an epoch (a pass) of s and of 2s steps (s: 100 for LR-HMDA and MLP-M4,
as many as the H200 profile's epoch; 14 for the LSTM, the Gram path's period of decisions, 2 for GPT-2): the difference over s is what each
step dispatches, the rest (a sort, the first step's set-up of the optimizer's state, the epoch's last
loss read) is once-per-epoch work, spread over the benchmark's real steps per epoch (paper settings,
all data) in kernel_ops_per_step. kernel_ops_per_step_in_slice is the s-step epoch's total / s, which
is how bench/gpu_profile.py's launches per step count it (LR-HMDA and MLP-M4: 100 steps, as the H200's).

The compiled step (--compile inductor, engine/compiled.py; LR-HMDA and MLP-M4, "compiled" in the JSON): a
dispatch mode turns torch.compile off (dynamo runs the step eagerly under one), so these runs are counted by
`ProfiledCounter` instead, from torch.profiler's CPU events with inductor's generated C++ kernels recorded
as events of their own (torch._inductor.config.cpp.enable_kernel_profile): each fused kernel counts once,
and so does each outermost ATen operator with a kernel of its own (not a view, not NO_KERNEL, not an implicit
composite, whose children are what runs), as the dispatch mode counts them. D-RR and CD-GraB with the Gram
sign loop (the GPU's path) are counted eager and compiled, both this way and in their second epoch (the
first compiles), over epochs of s and 2s steps as above (`--no-compiled` skips them).

Writes one JSON object (default bench/results/dispatch-count-cpu.json) and prints it: git_commit (of the
code it ran), torch, command, goals (issue #62's upper bounds: CD-GraB <= 1.3x D-RR, D-RR <= 1.2x the
textbook loop, in kernel ops), and per benchmark the counts per step, ratios, meets_goals, the H200
profile's launches per step where it has the benchmark (read from its text file) and the proxy's ratio
to them, and each run's most frequent kernel ops per step.
"""
import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere

from bench.gpu_epochs import (  # noqa: E402
    TEXTBOOK_LOSS,
    build_task,
    real_steps_per_epoch,
    textbook_model,
    textbook_pass,
)
from common.errors import OneLineErrorParser, UserFacingError  # noqa: E402
from common.paths import default_data_dir  # noqa: E402
from engine import functional, runlog  # noqa: E402
from engine.cli import int_flag  # noqa: E402
from engine.comm import LocalCommunicator  # noqa: E402
from engine.compiled import COMPILED_BENCHMARKS  # noqa: E402
from engine.train import train  # noqa: E402
from sorters import balance  # noqa: E402

# operators that launch no kernel on a GPU: allocation, metadata, a read of one value to the host
# (a device-to-host copy and a synchronisation, not a launch)
NO_KERNEL = frozenset({"aten.empty", "aten.empty_strided", "aten.empty_like", "aten._unsafe_view", "aten.alias",
                       "aten.lift_fresh", "aten.resize_", "aten.set_", "aten._reshape_alias", "aten.as_strided",
                       "aten._local_scalar_dense", "aten.sym_size", "aten.sym_stride", "aten.sym_numel",
                       "aten.sym_storage_offset", "aten.unsqueeze_", "aten.squeeze_", "aten.t_", "aten.transpose_",
                       "aten.detach_", "aten.is_same_size"})
# steps per counted epoch (s; the long epoch 2s): even, as D-RR and CD-GraB pair steps; the LSTM's 14 are the Gram
# path's period (7 pairs of steps kept, then decided: CDGraB.DEFERRED_BYTES), so that the long epoch holds one
# decision more than the short one (fewer steps than a period would count the kept steps without their decision)
STEPS = {"LR-HMDA": 100, "MLP-M4": 100, "LSTM-Wiki2": 14, "GPT2-Wiki103": 2}
# flags beside the paper's settings: GPT-2's blocks of 32 tokens instead of 128 run the same operators on
# shorter tensors (--gpt2-max-seq-length 128 counts the paper's blocks, about 4x slower); --grad-chunk all is
# what its default (auto) takes on a GPU: a step's 64 blocks in one gradient pass, not the CPU's passes of 16
SLICE_FLAGS = {"GPT2-Wiki103": ["--max-seq-length", "{gpt2_max_seq_length}", "--grad-chunk", "all"]}
RUNS = ("textbook", "textbook foreach", "D-RR", "CD-GraB", "CD-GraB gram")
GOALS = {"CD-GraB/D-RR": 1.3, "D-RR/textbook": 1.2}  # issue #62's upper bounds, in kernel ops per step
COUNTED_EPOCH = 1  # no warm-up needed: per_step() separates the first step's set-up as once-only work
# the compiled step's runs (ProfiledCounter), each as eager and as --compile inductor, counted in epoch 2: the
# first compiles (dynamo's tracing runs operators of its own, which are no step's)
COMPILED_RUNS = ("D-RR", "CD-GraB gram")
COMPILED_COUNTED_EPOCH = 2
H200_PROFILE = REPO / "bench" / "results" / "gpu-profile-NVIDIA-H200-2026-11-27.txt"
DEFAULT_JSON = REPO / "bench" / "results" / "dispatch-count-cpu.json"
TOP = 12  # kernel ops listed per run


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched while it is active (`with OpCounter() as counter:`), on this
    thread. `calls` maps "aten.<op>" to its calls; `views` holds the names that were views."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.views: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.calls[name] += 1
        if func.is_view:
            self.views.add(name)
        return func(*args, **(kwargs or {}))

    @property
    def dispatched(self) -> int:
        return sum(self.calls.values())

    def kernel_calls(self) -> collections.Counter:
        """The calls of operators that work on tensor data: not views, not in NO_KERNEL, not the profiler's
        markers (torch.optim's record_function ranges)."""
        return collections.Counter({name: count for name, count in self.calls.items() if name not in self.views
                                    and name not in NO_KERNEL and not name.startswith("profiler.")})

    @property
    def kernel_ops(self) -> int:
        return sum(self.kernel_calls().values())


class ProfiledCounter:
    """Counts kernels from torch.profiler's CPU events while active (`with ProfiledCounter() as counter:`),
    for code a dispatch mode cannot watch (a torch.compile'd step). An event of inductor's generated kernels
    (with cpp.enable_kernel_profile on, when the code was generated: the runs set it before compiling) counts
    once as "inductor.<its fused operators>"; an ATen operator event counts as "aten.<op>" when the operator
    has a kernel of its own (not a view, not in NO_KERNEL, not implemented only as a CompositeImplicitAutograd)
    and no event around it counted already (its children are its kernel's work, as the dispatch mode sees a
    composite with its own kernel once). Offers OpCounter's `calls`, `views`, `dispatched`, `kernel_calls()`
    and `kernel_ops` (`calls` holds only the counted events; `dispatched` counts the outermost ATen events
    and the kernels)."""

    INDUCTOR_KERNEL = "cpp_fused_"  # in the name of every generated C++ kernel's event

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()
        self.views: set[str] = set()
        self.dispatched = 0
        self._profile = profile(activities=[ProfilerActivity.CPU])
        self._kinds: dict[str, str] = {}

    def __enter__(self) -> "ProfiledCounter":
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        for event in self._profile.events():
            counted = self._counted_name(event.name)
            if counted is None or self._under_a_counted_event(event):
                continue
            self.calls[counted] += 1
        self.dispatched = sum(1 for event in self._profile.events() if event.name.startswith("aten::")
                              and not self._has_aten_parent(event)) + sum(
            count for name, count in self.calls.items() if name.startswith("inductor."))

    def _kind(self, op: str) -> str:
        """"kernel", "view" (views and NO_KERNEL) or "composite" (CompositeImplicitAutograd only) for aten op."""
        if op not in self._kinds:
            packet = getattr(torch.ops.aten, op, None)
            overloads = [getattr(packet, name) for name in packet.overloads()] if packet is not None else []
            if not overloads or any(o.is_view for o in overloads) or f"aten.{op}" in NO_KERNEL:
                self._kinds[op] = "view"
            elif all(torch._C._dispatch_has_kernel_for_dispatch_key(o.name(), "CompositeImplicitAutograd")
                     for o in overloads):
                self._kinds[op] = "composite"
            else:
                self._kinds[op] = "kernel"
        return self._kinds[op]

    def _counted_name(self, name: str) -> str | None:
        if self.INDUCTOR_KERNEL in name:
            return "inductor." + name.split(self.INDUCTOR_KERNEL, 1)[1]
        if name.startswith("aten::") and self._kind(name[6:]) == "kernel":
            return "aten." + name[6:]
        return None

    def _under_a_counted_event(self, event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if self._counted_name(parent.name) is not None:
                return True
            parent = parent.cpu_parent
        return False

    @staticmethod
    def _has_aten_parent(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return True
            parent = parent.cpu_parent
        return False

    def kernel_calls(self) -> collections.Counter:
        return collections.Counter(self.calls)

    @property
    def kernel_ops(self) -> int:
        return sum(self.calls.values())


def totals(counter) -> dict:
    """What a counted epoch (or pass) leaves: {"dispatched": calls, "kernel_ops": kernel calls per op}."""
    return {"dispatched": counter.dispatched, "kernel_ops": counter.kernel_calls()}


def per_step(short: dict, long: dict, steps: int, steps_per_epoch: int) -> dict:
    """Per-step counts at the benchmark's real epoch length from totals() of two counted epochs, of `steps`
    (short) and 2 * `steps` (long) steps: each step's own operators are (long - short) / steps, the
    epoch's once-only ones (a sort, the last loss read) 2 * short - long, spread over steps_per_epoch.
    Also the short epoch's plain total / steps (`in_slice`, as bench/gpu_profile.py counts launches)."""
    def at_epoch(short_count: float, long_count: float) -> float:
        each_step, once = (long_count - short_count) / steps, 2 * short_count - long_count
        return round(each_step + once / steps_per_epoch, 2)

    kernels = collections.Counter({name: at_epoch(short["kernel_ops"][name], long["kernel_ops"][name])
                                   for name in short["kernel_ops"] | long["kernel_ops"]})
    short_kernels, long_kernels = sum(short["kernel_ops"].values()), sum(long["kernel_ops"].values())
    return {"dispatched": at_epoch(short["dispatched"], long["dispatched"]),
            "kernel_ops": at_epoch(short_kernels, long_kernels),
            "kernel_ops_in_slice": round(short_kernels / steps, 2),
            "kernel_ops_once_per_epoch": 2 * short_kernels - long_kernels,
            "top_kernel_ops": {name: count for name, count in kernels.most_common(TOP)}}


def count_textbook(benchmark: str, steps: int, data_dir: str, foreach: bool, flags: list[str]) -> dict:
    """totals() of the textbook loop's first pass over `steps` steps."""
    device = torch.device("cpu")
    args, task = build_task(benchmark, steps, data_dir, device, flags)
    model = textbook_model(task)
    if task.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                    weight_decay=args.weight_decay, foreach=foreach)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, foreach=foreach)
    step_loss = TEXTBOOK_LOSS[benchmark](task, model)
    with OpCounter() as counter:
        textbook_pass(model, optimizer, step_loss, steps, task.clip_grad_norm)
    return totals(counter)


def count_engine(benchmark: str, sorter: str, steps: int, data_dir: str, sign_loop: str | None,
                 flags: list[str], counter=None, counted_epoch: int = COUNTED_EPOCH) -> dict:
    """totals() of epoch `counted_epoch` of the engine's training, counted from the epoch's start to its last
    step (the two Task calls the engine makes around an epoch's training, as bench/gpu_epochs.EpochProbe), by
    `counter` (an OpCounter unless given; a ProfiledCounter for --compile runs)."""
    device, counter = torch.device("cpu"), counter or OpCounter()
    # the Gram path's sign tables are made once per process and size: cleared, every run makes its own, in the
    # short epoch and the long alike, and they count as once-only work (not as the long epoch's steps' work less
    # the tables, which an earlier run's tables would make them)
    balance._sign_vectors.cache_clear()
    # --overlap off: the counter sees one thread, and with auto a long model's sorter steps in a background
    # thread (the same operators, elsewhere)
    extra = ["--sorter", sorter, "--epochs", str(counted_epoch), "--progress", "off", "--max-eval-examples", "1",
             "--overlap", "off", *flags]
    with tempfile.TemporaryDirectory() as out:
        args, task = build_task(benchmark, steps, data_dir, device,
                                [*extra, "--out", out, *(["--sign-loop", sign_loop] if sign_loop else [])])
        start_epoch, evaluate, state = task.start_epoch, task.evaluate, {}

        def start(epoch):
            state["epoch"] = epoch
            if epoch == counted_epoch:
                counter.__enter__()
            start_epoch(epoch)

        def evaluate_after_training(flat, comm):
            if state["epoch"] == counted_epoch:
                counter.__exit__(None, None, None)
            return evaluate(flat, comm)

        task.start_epoch, task.evaluate = start, evaluate_after_training
        # the Gram sign loop is the GPU's path; so is writing per-unit products into their gradient columns
        previous, functional.PRODUCTS_INTO_SLOTS = functional.PRODUCTS_INTO_SLOTS, sign_loop == "gram" or None
        try:
            train(task, args, LocalCommunicator(args.node_cnt, device), device)
        finally:
            functional.PRODUCTS_INTO_SLOTS = previous
    return totals(counter)


def count_run(run: str, benchmark: str, steps: int, data_dir: str, flags: list[str]) -> dict:
    """totals() of one of RUNS over an epoch (pass) of `steps` steps."""
    if run.startswith("textbook"):
        return count_textbook(benchmark, steps, data_dir, run == "textbook foreach", flags)
    sorter, _, sign_loop = run.partition(" ")
    return count_engine(benchmark, sorter, steps, data_dir, sign_loop or None, flags)


def count_compiled_run(run: str, compiled: bool, benchmark: str, steps: int, data_dir: str) -> dict:
    """totals() of one of COMPILED_RUNS, eager or with --compile inductor, counted by a ProfiledCounter in
    epoch COMPILED_COUNTED_EPOCH of `steps` steps."""
    import torch._dynamo
    import torch._inductor.config

    sorter, _, sign_loop = run.partition(" ")
    torch._dynamo.reset()  # a fresh task: its methods compile afresh, not against the last run's guards
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):  # each generated kernel an event
        return count_engine(benchmark, sorter, steps, data_dir, sign_loop or None,
                            ["--compile", "inductor" if compiled else "off"], counter=ProfiledCounter(),
                            counted_epoch=COMPILED_COUNTED_EPOCH)


def compiled_report(counts: dict) -> dict:
    """A benchmark's "compiled" entry from per_step() counts of each COMPILED_RUNS run, eager and compiled
    (keys "<run>" and "<run> compiled")."""
    kernel = {run: counts[run]["kernel_ops"] for run in counts}
    return {"counted_by": "ProfiledCounter (torch.profiler events; inductor's kernels one each)",
            "counted_epoch": COMPILED_COUNTED_EPOCH, "compile": "inductor",
            "kernel_ops_per_step": kernel,
            "compiled_over_eager": {run: round(kernel[f"{run} compiled"] / kernel[run], 3) for run in COMPILED_RUNS},
            "CD-GraB/D-RR": {variant: round(kernel[f"CD-GraB gram{suffix}"] / kernel[f"D-RR{suffix}"], 3)
                             for variant, suffix in (("eager", ""), ("compiled", " compiled"))},
            "top_kernel_ops_per_step": {run: counts[run]["top_kernel_ops"] for run in counts}}


def h200_launches(profile: Path = H200_PROFILE) -> dict:
    """benchmark -> sorter -> kernel launches per step, from bench/gpu_profile.py's text file."""
    import re

    found: dict = {}
    for benchmark, sorter, launches in re.findall(r"^== (\S+) (\S+): .*per step: ([\d.]+) kernel launches",
                                                  profile.read_text(), flags=re.M):
        found.setdefault(benchmark, {})[sorter] = float(launches)
    return found


def benchmark_report(counts: dict, steps: int, steps_per_epoch: int, h200: dict | None,
                     flags: list[str] | None = None) -> dict:
    """One benchmark's entry from its runs' per_step() counts."""
    kernel = {run: counts[run]["kernel_ops"] for run in counts}
    ratios = {"CD-GraB/D-RR": round(kernel["CD-GraB gram"] / kernel["D-RR"], 3),
              "CD-GraB/D-RR (CPU sign loop)": round(kernel["CD-GraB"] / kernel["D-RR"], 3),
              "D-RR/textbook": round(kernel["D-RR"] / kernel["textbook foreach"], 3),
              "D-RR/textbook (per-parameter optimizer)": round(kernel["D-RR"] / kernel["textbook"], 3)}
    entry = {
        "steps_counted": [steps, 2 * steps],
        "steps_per_epoch": steps_per_epoch,
        "flags_beside_paper_settings": flags or [],
        "kernel_ops_per_step": kernel,
        "dispatched_per_step": {run: counts[run]["dispatched"] for run in counts},
        "kernel_ops_per_step_in_slice": {run: counts[run]["kernel_ops_in_slice"] for run in counts},
        "kernel_ops_once_per_epoch": {run: counts[run]["kernel_ops_once_per_epoch"] for run in counts},
        "ratios": ratios,
        "meets_goals": {goal: ratios[goal] <= bound for goal, bound in GOALS.items()},
        "h200_launches_per_step": h200,
        "proxy_over_h200": None,
        "top_kernel_ops_per_step": {run: counts[run]["top_kernel_ops"] for run in counts},
    }
    if h200:  # the GPU proxy against the H200 profile's launches, both over an epoch of `steps` steps
        proxy = {sorter: counts[run]["kernel_ops_in_slice"] for sorter, run in (("D-RR", "D-RR"),
                                                                                ("CD-GraB", "CD-GraB gram"))}
        entry["proxy_over_h200"] = {sorter: round(proxy[sorter] / launches, 3) for sorter, launches in h200.items()}
    return entry


def make_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=default_data_dir(),
                        help="data folder (default $CDGRAB_DATA, else ./datasets)")
    parser.add_argument("--benchmarks", nargs="+", default=list(STEPS), choices=list(STEPS), metavar="NAME",
                        help=f"which benchmarks (default all: {' '.join(STEPS)})")
    parser.add_argument("--json", default=str(DEFAULT_JSON),
                        help=f"the report (default {DEFAULT_JSON.relative_to(REPO)})")
    parser.add_argument("--no-compiled", action="store_true",
                        help="skip the compiled step's counts (--compile inductor: about 20 s of C++ compiling a run "
                             "for LR-HMDA, minutes for MLP-M4's rollout)")
    parser.add_argument("--gpt2-max-seq-length", type=int_flag(1), default=32, metavar="T",
                        help="GPT-2's tokens per block (default 32: the paper's 128 runs the same operators, slower)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    if not Path(args.data_dir).is_dir():
        print(f"error: --data-dir {args.data_dir} is not a folder; point it (or $CDGRAB_DATA) at the data sets",
              file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)  # counts do not depend on it; keeps the bench off the other cores
    started, h200 = time.perf_counter(), h200_launches()
    report = {"bench": "bench/dispatch_count.py", "git_commit": runlog.git_commit(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"),
              "command": "python bench/dispatch_count.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "counted": "kernel_ops: ATen operators dispatched (TorchDispatchMode), less views and allocation/"
                         "metadata calls; per training step at the real epoch length (steps_per_epoch) from two "
                         "counted epochs (passes) of steps_counted steps: (long - short) / steps each step, "
                         "2 short - long once per epoch; kernel_ops_per_step_in_slice: the short epoch's total / steps",
              "goals": GOALS, "h200_profile": H200_PROFILE.name, "benchmarks": {}}
    try:
        for benchmark in args.benchmarks:
            steps, counts = STEPS[benchmark], {}
            flags = [flag.format(gpt2_max_seq_length=args.gpt2_max_seq_length)
                     for flag in SLICE_FLAGS.get(benchmark, [])]
            steps_per_epoch = real_steps_per_epoch(benchmark, args.data_dir)  # the paper's settings, all data
            for run in RUNS:
                short, long = (count_run(run, benchmark, n, args.data_dir, flags) for n in (steps, 2 * steps))
                counts[run] = per_step(short, long, steps, steps_per_epoch)
            report["benchmarks"][benchmark] = benchmark_report(counts, steps, steps_per_epoch, h200.get(benchmark),
                                                               flags)
            if benchmark in COMPILED_BENCHMARKS and not args.no_compiled:
                compiled = {}
                for run in COMPILED_RUNS:
                    for on in (False, True):
                        short, long = (count_compiled_run(run, on, benchmark, n, args.data_dir)
                                       for n in (steps, 2 * steps))
                        compiled[run + " compiled" * on] = per_step(short, long, steps, steps_per_epoch)
                report["benchmarks"][benchmark]["compiled"] = compiled_report(compiled)
            print(f"{benchmark}: {report['benchmarks'][benchmark]['kernel_ops_per_step']}", file=sys.stderr)
    except UserFacingError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(report, indent=1)
    Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
