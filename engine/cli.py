"""The command line shared by every entry script, and its checks."""
import argparse
import json
import math
from pathlib import Path

from common.errors import OneLineErrorParser, UserFacingError
from common.paths import default_data_dir
from engine.compiled import COMPILE_CHOICES, check_compile_args
from engine.flags import FLAGS, NAMED_BY_VALUE, RESUMABLE_FLAGS, changed_on_resume
from engine.local_sgd import SYNC_RULES, check_sync_args
from engine.optim import LRSchedule
from engine.reducers import REDUCER_NAMES
from engine.rundir import check_out_path
from engine.sketching import STRUCTURED_MIN_NUMEL, check_sketch_args
from sorters import SORTER_NAMES
from sorters.thresholds import MIN_NUMEL_FLOOR

# --progress auto without a terminal (nohup, sweeps' logs, CI): seconds between plain progress lines
# (engine.progress.ProgressLines). Under a minute, so that a log shows the run alive every minute while steps
# take under 15 s; not much less, so that a day-long run's log stays short. $CDGRAB_PROGRESS_EVERY
# overrides it (the tests use a tiny one).
PROGRESS_EVERY_SECONDS = 45.0


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help already says it or there is none to show."""

    def _get_help_string(self, action):
        if "default" in (action.help or "") or action.default is None or action.default is False \
                or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


# Ranges of the numeric flags, checked as the command line is parsed (int_flag, float_flag): a value out
# of range is refused in one line before anything runs. Seeds: what every generator the suite seeds
# takes (numpy's RandomState: below 2^32). Counts: below 2^31 (int32 indices). Floats must be finite;
# the upper limits keep float32 arithmetic finite (an --lr of 1e308 overflows the first SGD step).
MAX_SEED, MAX_COUNT, MAX_LR = 2**32 - 1, 2**31 - 1, 1e4


def int_flag(low: int, high: int = MAX_COUNT):
    """An argparse `type=`: a whole number in [low, high], else one line (ArgumentTypeError)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}" if value < low
                                             else f"must be <= {high}, got {value}")
        return value
    return parse


def float_flag(low: float, high: float, low_open: bool = False, high_open: bool = False):
    """An argparse `type=`: a finite number in the interval from low to high (open at an end when asked),
    else one line (ArgumentTypeError); NaN and inf never pass."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        inside = (low < value if low_open else low <= value) and (value < high if high_open else value <= high)
        if not inside:  # NaN fails every comparison
            raise argparse.ArgumentTypeError(f"must be a finite number in {interval}, got {text}")
        return value
    return parse


def flag_name(dest: str) -> str:
    """--flag as the user types it, from its argparse dest (the paper's underscore spellings kept)."""
    return "--" + (dest if dest in ("node_cnt", "weight_decay") else dest.replace("_", "-"))


def common_parser(benchmark: str, description: str, defaults: dict,
                  help_texts: dict | None = None) -> argparse.ArgumentParser:
    """The flags every main-*.py takes. description: the script's docstring (its first paragraph is
    shown); defaults: the benchmark's paper settings; help_texts: what --max-train-examples /
    --max-eval-examples count for this benchmark ({dest: help})."""
    texts = dict(help_texts or {})
    if set(texts) - {"max_train_examples", "max_eval_examples"}:
        raise ValueError(f"common_parser: help_texts may replace max_train_examples and max_eval_examples, "
                         f"got {sorted(texts)}")
    p = OneLineErrorParser(description=description.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    # --help lists the flags in the order added: the paper's settings, the run's files and device, how a
    # step is computed, then the two groups
    add_paper_flags(p, defaults)
    add_run_flags(p, benchmark, texts)
    add_step_flags(p)
    add_schedule_flags(p)
    add_communication_flags(p)
    return p


def add_paper_flags(p, defaults: dict) -> None:
    """The settings the paper states per benchmark (defaults: the benchmark's values)."""
    p.add_argument("--sorter", choices=SORTER_NAMES, default=defaults["sorter"],
                   help="example-order algorithm: CD-GraB (coordinated pair balance), D-RR (random "
                        "reshuffling per worker), D-SO (shuffle once), I-B / I-PB (independent mean / pair balance), "
                         "Fold (ablation: the fixed order the original's buggy CD-GraB applied every epoch: bug 1 in "
                         "docs/differences.md), "
                         "KH-SGD / SBW (CD-GraB's coordinated pair balance with the randomised threshold of kernel "
                         "halving / the self-balancing walk, Carrell et al. 2025; both depend on --epochs; "
                         "docs/reorderers.md)")
    p.add_argument("--seed", type=int_flag(0, MAX_SEED), default=defaults.get("seed", 0),
                   help="seeds the model initialisation, the data split and the sorter")
    p.add_argument("--lr", type=float_flag(0, MAX_LR, low_open=True), default=defaults["lr"], help="initial learning rate")
    p.add_argument("--momentum", type=float_flag(0, 1, high_open=True), default=defaults.get("momentum", 0.9),
                   help="SGD momentum (ignored by AdamW)")
    p.add_argument("--weight_decay", "--weight-decay", type=float_flag(0, MAX_LR), metavar="WD", default=defaults.get("weight_decay", 0.0), help="weight decay")
    p.add_argument("--B", type=int_flag(1), default=defaults["B"],
                   help="global batch per step over all workers; each worker takes B / node_cnt")
    p.add_argument("--node_cnt", "--node-cnt", type=int_flag(1), metavar="N", default=defaults["node_cnt"],
                   help="number of logical workers n (all in one process, or n / nproc per torchrun process)")
    p.add_argument("--epochs", type=int_flag(1), default=defaults["epochs"], help="training epochs")


def add_run_flags(p, benchmark: str, texts: dict) -> None:
    """The run's data and folder, its device, and what it shows; texts: common_parser's help_texts."""
    p.add_argument("--data-dir", default=default_data_dir(),
                   help="folder holding the data sets (default: $CDGRAB_DATA, else ./datasets)")
    p.add_argument("--out", default=None,
                   help=f"run directory (default: results/{benchmark}/<sorter>-node<n>-B<B>-lr<lr>[-<value>]-seed<seed>, "
                        f"with -<value> for each of {', '.join(map(flag_name, NAMED_BY_VALUE))} not at its default, "
                        "then -<flag><value> for every other setting not at its default that changes results, e.g. "
                        "-max-train-examples8000; never the flags that may change on --resume)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when available, else CPU")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="torch.distributed backend under torchrun (default: nccl on CUDA, gloo on CPU)")
    p.add_argument("--tf32", action="store_true",
                   help="allow TensorFloat-32 in CUDA matrix products and cuDNN convolutions/RNNs: faster on "
                        "Ampere and later GPUs, about 1e-3 relative error (default off: full float32); recorded "
                        "in config.json; no effect on the CPU")
    p.add_argument("--max-train-examples", type=int_flag(1), default=None, metavar="N",
                   help=texts.get("max_train_examples", "use only the first N training units (quick runs); also "
                                                        "limits the full-train evaluation"))
    p.add_argument("--max-eval-examples", type=int_flag(1), default=None, metavar="N",
                   help=texts.get("max_eval_examples", "cap the validation/test sets at N units (quick runs)"))
    p.add_argument("--resume", action="store_true",
                   help="continue from <out>/checkpoint.pt when it exists, else start the run; but with the default "
                        f"--out, when that folder does not exist and results/{benchmark}/ holds other runs, name "
                        "the nearest one and what differs, and exit 2 (a changed setting names another folder). "
                        "Only these settings "
                        "may differ from the checkpoint's: "
                        + ", ".join(sorted(map(flag_name, RESUMABLE_FLAGS - {"out", "resume"})))
                        + " (--epochs not with --lr-schedule cosine/linear; --cache-dir: GPT-2)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run in --out: delete its checkpoint.pt, orders.pt, metrics.csv and config.json "
                        "and start a new run there. Without it a folder holding results (metrics.csv epochs without a "
                        "checkpoint.pt to continue from, e.g. a finished run) or a config.json / metrics.csv this suite "
                        "did not write is refused (docs/run-directory.md)")
    p.add_argument("--record-orders", action="store_true",
                   help="also save every epoch's (n, m) orders to <out>/orders.pt")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress within an epoch, shown by rank 0 on stderr. auto: a tqdm bar when stderr is a "
                        f"terminal, else (nohup, a sweep's log, CI) a plain line every {PROGRESS_EVERY_SECONDS:g} s with the epoch, step, "
                        "loss and estimated time left; on: the tqdm bar even when stderr is no terminal; off: "
                        "neither. Every mode prints the run directory when the run starts and ends, and one line "
                        "per epoch")


def add_step_flags(p) -> None:
    """How a step computes, sketches and exchanges its gradients, and how long a collective may wait."""
    p.add_argument("--unit-grads", choices=("auto", "vmap"), default="auto",
                   help="per-unit gradients for the balancing sorters: auto = one backward plus per-unit outer "
                        "products where the model allows it (Linear/Conv1D/Embedding/LayerNorm: LR, MLP, GPT-2), "
                        "else the benchmark's own path; with local steps (--sync) each worker's gradient at its own "
                        "parameters from one batched pass for LR and MLP; vmap = "
                        "torch.func.vmap over grad for both (the general path; equal to float32 rounding)")
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="run the balancing sorters' step t in a background thread while step t + 1 computes "
                        "(the same orders either way; costs a second per-unit gradient buffer). auto: on "
                        "when d >= 65,536 (the balancing costs more than the hand-off) and that buffer is at "
                        "most 256 MB (on for the LSTM, off for GPT-2: 1.75 GB)")
    p.add_argument("--log-herding", action="store_true",
                   help="add a herding_bound column to metrics.csv: per epoch, the parallel herding bound of the "
                        "epoch's per-unit gradients in the order used (engine/herding_log.py; keeps n*m*d floats, "
                        "at most 512 MB; D-RR and the other non-balancing sorters compute per-unit gradients for it)")
    p.add_argument("--sketch-dim", type=int_flag(0), default=0, metavar="D",
                   help="balancing sorters (CD-GraB, I-B, I-PB, KH-SGD, SBW, Greedy, MB-GraB, RPB) balance D-dimensional "
                        "CountSketches "
                        "of the per-unit gradients (sorters/sketch.py), made by each process before the all-gather: n*k*D floats "
                        "gathered per step instead of n*k*d, plus the update's all-reduce (n*d). 0 (default): exact "
                        "balancing; D >= d: exact too (the identity). docs/sketching.md")
    p.add_argument("--sketch-min-numel", type=int_flag(MIN_NUMEL_FLOOR), default=STRUCTURED_MIN_NUMEL, metavar="N",
                   help="with --sketch-dim: the weights of Linear / Conv1D / Embedding layers with at least N "
                        f"entries are TensorSketch blocks of the map, the rest CountSketched (default {STRUCTURED_MIN_NUMEL}: "
                        "GPT-2's tied embedding only); where the model allows it, the sketches of blocks of more than "
                        "min(256 D, 2^20) entries come from the layer records without forming their per-unit "
                        "gradients (smaller ones are formed: cheaper). docs/sketching.md")
    p.add_argument("--exact-low-memory", choices=("off", "on"), default="off",
                   help="CD-GraB only: on = balance the exact per-unit gradients without forming them as n*k*d floats: "
                        "the sorter takes inner products of the layer records of the step's own backward (sorters."
                        "ExactCDGraB; the same orders, up to counted near-ties). Models made of Linear / Conv1D / "
                        "Embedding / LayerNorm layers (LR, MLP, GPT-2), data-parallel steps. Where it saves memory "
                        "and where it does not (a layer's records outweigh its gradient when its tokens are many "
                        "against its width): docs/exact-cdgrab.md")
    p.add_argument("--sign-loop", choices=("auto", "compiled", "gram"), default="auto",
                   help="CD-GraB's sequential sign loop (the same signs either way): compiled = numba's one-pass "
                        "loop (CPU only), gram = a few matrix products per step (the GPU path). auto: gram on GPUs; "
                        "on the CPU compiled, except with --sketch-dim on a model of 2^20 parameters or more "
                        "(LSTM, GPT-2), where the step dwarfs the loop and numba's resident memory would show. docs/sketching.md")
    p.add_argument("--compile", choices=COMPILE_CHOICES, default="off",
                   help="torch.compile the data-parallel step's gradients (LR-HMDA: its closed forms; MLP-M4: the "
                        "batch gradient's rollout and backward, and the per-window gradients; engine/compiled.py): "
                        "inductor = fused kernels (fewer "
                        "GPU launches; a C compiler on the CPU; the first steps compile, about 20 s), aot_eager = the "
                        "traced graphs run operator by operator (a check: the eager step's arithmetic). The same "
                        "orders; losses to float32 rounding. off (default): eager")
    p.add_argument("--dist-timeout", type=float_flag(0, 7 * 24 * 3600, low_open=True), default=300.0, metavar="SECONDS",
                   help="torch.distributed collective timeout; a dead rank is normally detected at once")


def add_schedule_flags(p) -> None:
    """The learning-rate schedule (LRSchedule), in a group of its own in --help."""
    schedule = p.add_argument_group("learning-rate schedule")
    schedule.add_argument("--lr-schedule", choices=LRSchedule.KINDS, default="step",
                          help="step: the benchmark's paper schedule (constant, or the step decay its script "
                               "names); cosine / linear: from --lr down to --min-lr at the last epoch")
    schedule.add_argument("--warmup-epochs", type=float_flag(0, MAX_COUNT), default=0.0, metavar="E",
                          help="linear warm-up from --min-lr to --lr over the first E epochs (fractions allowed)")
    schedule.add_argument("--min-lr", type=float_flag(0, MAX_LR), default=0.0, help="floor of the cosine/linear decay and warm-up start")


def add_communication_flags(p) -> None:
    """Local SGD (--sync, engine/local_sgd.py) and sparsified reduction (--reducer, engine/reducers.py)."""
    sync = p.add_argument_group("communication: local SGD (--sync) and sparsified reduction (--reducer)")
    sync.add_argument("--sync", choices=SYNC_RULES, default="every-step",
                      help="every-step: average gradients every step (data-parallel, the paper). constant: each "
                           "worker steps on its own parameters and optimizer state, parameters averaged every --H "
                           "steps. qsr: H = max(H_base, floor((alpha/lr)^power)) (Gu et al. 2024), recomputed at "
                           "each round's first step. linear: the same with power 1. post-local: data-parallel "
                           "until --switch-epoch, then constant --H. Every epoch ends with an averaging step")
    sync.add_argument("--H", type=int_flag(1), default=4, help="steps between averagings for --sync constant / post-local")
    sync.add_argument("--alpha", type=float_flag(0, MAX_LR), default=None, help="growth coefficient of --sync qsr / linear")
    sync.add_argument("--H-base", type=int_flag(1), default=4, help="floor of H after warm-up for --sync qsr / linear")
    sync.add_argument("--H-init", type=int_flag(1), default=None,
                      help="H during the learning-rate warm-up and when alpha = 0 (default: --H-base)")
    sync.add_argument("--power", type=float_flag(0, 16, low_open=True), default=2.0, help="exponent of --sync qsr (linear uses 1)")
    sync.add_argument("--switch-epoch", type=int_flag(1), default=None, metavar="E",
                      help="--sync post-local: data-parallel during epochs 1..E-1, local steps from epoch E")
    # Gu et al. 2024 average AdamW's two moments under separate switches and never SGD's momentum
    sync.add_argument("--avg-m", action="store_true",
                      help="with local steps and AdamW, also average the first moment (exp_avg) at each averaging "
                           "(default: it stays per worker)")
    sync.add_argument("--avg-v", action="store_true",
                      help="with local steps and AdamW, also average the second moment (exp_avg_sq) at each "
                           "averaging (default: it stays per worker)")
    sync.add_argument("--average-opt-state", action="store_true",
                      help="replaced by --avg-m and --avg-v (refused: it also averaged SGD momentum)")
    sync.add_argument("--unit-grad-gather", choices=("round", "step"), default="round",
                      help="with local steps, when the balancing sorters' unit gradients are all-gathered: once "
                           "per round (at the latest every 64 MB) or every step; the same bytes and orders, fewer "
                           "collectives per round (bench/gather_batching.py)")
    sync.add_argument("--reducer", choices=REDUCER_NAMES, default="dense",
                      help="how the averaged quantity (the gradient each step, or with local steps the change of "
                           "the parameters since the last averaging) is exchanged: dense all-reduce; topk: each "
                           "worker's top density*d entries with error feedback, averaged on the union of indices; "
                           "exdyna: ExDyna (Yoon & Oh 2024) exclusive partitions with an adaptive threshold")
    sync.add_argument("--density", type=float_flag(0, 1, low_open=True), default=None,
                      help="fraction of the d coordinates selected per exchange for --reducer topk / exdyna")


def out_tags(args, defaults: dict) -> str:
    """-<value> per setting named by value (engine.flags), then -<flag><value> per other result-changing
    setting, that differs from `defaults`: a smoke run (--max-train-examples) and the full run get
    different folders."""
    tags = [str(getattr(args, key)) for key in NAMED_BY_VALUE
            if hasattr(args, key) and getattr(args, key) != defaults.get(key)]
    for key, value in vars(args).items():
        if FLAGS[key].resumable or FLAGS[key].out != "tag" or key not in defaults or value == defaults[key]:
            continue
        flag = key.replace("_", "-")
        if value is True:
            tags.append(flag)
            continue
        if isinstance(value, float):
            value = f"{value:g}"
        elif isinstance(value, str) and ("/" in value or "\\" in value):
            value = "-".join(value.replace("\\", "/").rstrip("/").split("/")[-2:])  # a file: its folder and name
        tags.append(f"{flag}{value}")
    return "".join(f"-{tag}" for tag in tags).replace(":", "").replace(" ", "")


def sweep_tags(parser, benchmark: str, fixed: list[str], extra: list[str], sorters=()) -> str:
    """The run-name tag of a sweep's runs (scripts/sweep-common.sh): out_tags of the run's arguments
    `fixed + extra` against `fixed` (the sweep's own: paper settings and benchmark flags), so every
    result-changing setting the user's extra arguments change is named, e.g. -sketch-dim64 or
    -max-train-examples512; "" when they change none. Before any run starts, the extra arguments are
    parsed and checked as each of `sorters`' runs will be (after --sorter S --seed N, as the sweep
    passes them): a bad one exits 2 with the entry script's one-line error."""
    defaults = vars(parser.parse_args(fixed))
    for sorter in sorters:
        args = parser.parse_args(["--sorter", sorter, "--seed", "0", *fixed, *extra])
        seed_kept = parser.parse_args(["--seed", "1", *fixed, *extra]).seed == 1
        if args.sorter != sorter or args.seed != 0 or not seed_kept:  # the extra arguments override them
            raise UserFacingError("the sweep sets --sorter and --seed of each run (and names the run by them): "
                                  "drop them from the extra arguments and set SORTERS / SEEDS instead")
        check_args(args, benchmark)
    return out_tags(parser.parse_args([*fixed, *extra]), defaults)


def check_args(args, benchmark: str, defaults: dict | None = None) -> None:
    """Refuse bad settings with one line that says what to do; fill in the default --out (which names
    the settings that differ from `defaults`, the parser's defaults: out_tags)."""
    if args.node_cnt < 1:
        raise UserFacingError(f"--node_cnt must be >= 1, got {args.node_cnt}")
    if args.B < 1:
        raise UserFacingError(f"--B must be >= 1, got {args.B}")
    if args.B % args.node_cnt:
        raise UserFacingError(f"--B {args.B} is not divisible by --node_cnt {args.node_cnt}: "
                              f"each worker takes B / node_cnt units per step; pick B as a multiple of node_cnt")
    if args.epochs < 1:
        raise UserFacingError(f"--epochs must be >= 1, got {args.epochs}")
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise UserFacingError(f"--lr must be a positive number, got {args.lr}")
    for flag in ("max_train_examples", "max_eval_examples"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserFacingError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    check_communication_args(args)
    check_sketch_args(args)
    check_exact_args(args)
    check_compile_args(args, benchmark)
    if getattr(args, "sign_loop", "auto") != "auto" and args.sorter != "CD-GraB":
        raise UserFacingError(f"--sign-loop chooses CD-GraB's sign loop; {args.sorter} has none to choose: drop it")
    if getattr(args, "overwrite", False) and args.resume:
        raise UserFacingError("--overwrite starts the run in --out over and --resume continues it: pass one of them")
    if args.out is None:
        tags = out_tags(args, defaults) if defaults else ""
        args.out = f"results/{benchmark}/{args.sorter}-node{args.node_cnt}-B{args.B}-lr{args.lr:g}{tags}-seed{args.seed}"
    check_out_path(args.out)


def check_resume(args, benchmark: str, out_given: bool) -> None:
    """--resume with the default --out (out_given False) and no such folder, while the folder above it
    (results/<benchmark>/) holds runs with a checkpoint.pt: refuse in one line that names the folders looked at and
    the settings in which the nearest of those runs (fewest differences, then the newest) differs, since
    a changed setting names another folder and the user most likely meant to continue that run. With
    no run there at all it is a first start, and --resume starts it (as with an --out of one's own:
    the sweeps and scripts/gpu_session.py pass --resume on every start)."""
    out = Path(args.out)
    if not args.resume or out_given or out.exists() or not out.parent.is_dir():  # out: a run started before
        return
    runs = sorted(path for path in out.parent.iterdir() if (path / "checkpoint.pt").is_file())
    if not runs:
        return
    nearest, changed = min(((run, settings_changed(run, vars(args), benchmark)) for run in runs),
                           key=lambda pair: (len(pair[1]) if pair[1] is not None else math.inf,
                                             -(pair[0] / "checkpoint.pt").stat().st_mtime))
    looked = (f"--resume: no run to resume in {out} (no such folder); looked there and at the {len(runs)} "
              f"run{'s' * (len(runs) > 1)} with a checkpoint in {out.parent}/")
    if changed is None:
        raise UserFacingError(f"{looked}, whose config.json files are unreadable; continue one with --out "
                              f"{nearest}, or drop --resume to start a new run in {out}")
    if not changed:
        raise UserFacingError(f"{looked}: {nearest} has these settings (it was started with its own --out); "
                              f"continue it with --out {nearest}, or drop --resume to start a new run in {out}")
    raise UserFacingError(f"{looked}: the nearest, {nearest}, differs in {describe_changes(changed)}; to continue "
                          f"it, pass its settings (or give it as --out), or drop --resume to start a new run")


def settings_changed(run: Path, now: dict, benchmark: str) -> list | None:
    """changed_on_resume between the args in run/config.json and `now`; None when it cannot be read."""
    try:
        saved = json.loads((run / "config.json").read_text())["args"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return changed_on_resume(saved, now, benchmark) if isinstance(saved, dict) else None


def describe_changes(changed: list, most: int = 4) -> str:
    """'--lr 0.005 (now 0.01), --seed 0 (now 1)' from changed_on_resume's (dest, saved, now) triples; the
    first `most`, then how many more."""
    shown = ", ".join(f"{flag_name(key)} {saved} (now {now})" for key, saved, now in changed[:most])
    return shown + (f" and {len(changed) - most} more" if len(changed) > most else "")


def check_exact_args(args) -> None:
    """One-line errors for --exact-low-memory: CD-GraB's data-parallel steps, exact balancing."""
    if getattr(args, "exact_low_memory", "off") == "off":
        return
    clashes = [("--sorter " + args.sorter, args.sorter != "CD-GraB"), ("--sketch-dim", args.sketch_dim > 0),
               ("--sync " + args.sync, args.sync != "every-step"), ("--reducer " + args.reducer, args.reducer != "dense"),
               ("--overlap on", args.overlap == "on"), ("--log-herding", args.log_herding),
               ("--unit-grads vmap", args.unit_grads == "vmap"), ("--sign-loop " + args.sign_loop, args.sign_loop != "auto")]
    for flag, clash in clashes:
        if clash:
            raise UserFacingError(f"--exact-low-memory on balances CD-GraB's exact gradients in data-parallel steps "
                                  f"from layer records; it does not go with {flag}: drop one of them")


def check_communication_args(args) -> None:
    """One-line errors for the learning-rate schedule, --sync and --reducer flags."""
    if args.log_herding and (args.sync != "every-step" or args.reducer != "dense"):
        raise UserFacingError("--log-herding records the data-parallel path's per-unit gradients; it is not "
                              "available with --sync or --reducer (drop one of them)")
    if args.warmup_epochs < 0 or args.warmup_epochs >= args.epochs:
        raise UserFacingError(f"--warmup-epochs must be in [0, --epochs {args.epochs}), got {args.warmup_epochs:g}")
    if not (math.isfinite(args.min_lr) and 0 <= args.min_lr <= args.lr):
        raise UserFacingError(f"--min-lr must be between 0 and --lr {args.lr:g}, got {args.min_lr:g}")
    check_sync_args(args)
    if args.switch_epoch is not None and args.switch_epoch > args.epochs:
        raise UserFacingError(f"--switch-epoch {args.switch_epoch} is after the last epoch (--epochs {args.epochs})")
    if args.reducer == "dense":
        if args.density is not None:
            raise UserFacingError("--density only applies to --reducer topk or exdyna")
        return
    if args.density is None or not (0 < args.density <= 1):
        raise UserFacingError(f"--reducer {args.reducer} needs --density in (0, 1], got {args.density}")
    if args.sync == "post-local":
        raise UserFacingError(f"--sync post-local with --reducer {args.reducer} is not supported: the error-feedback "
                              "residual would mix gradients (before the switch) with parameter changes (after it); "
                              "use --sync constant or qsr, or --reducer dense")
