"""What each command-line setting means for a run's identity, in one table (FLAGS).

engine/cli.py builds the parser (spellings, types, choices, help); this table says, for every flag of
every entry script (keyed by its argparse dest):
- resumable: it may differ between a checkpoint and the run that resumes it: where the data and caches
  live, how the run is launched and logged, how long it runs; nothing that changes its results.
- added: the value a run made before the flag existed ran with, for config.json files and checkpoints
  that lack it (ORIGINAL: the flag was there from the start); a dict when it depends on the benchmark.
- out: how the default --out names it when it differs from its default: "stem" (always in the name:
  sorter, n, B, lr, seed), "value" (-<value>, for the settings a study compares), "tag" (-<flag><value>),
  "never" (it does not change results). Resumable flags are never named.

Read by engine/checkpoint.py (resume), engine/cli.py (the default --out, the --resume help) and analysis/
(which config.json settings make a run). Plain Python, no torch: the analysis imports it cheaply.
tests/test_engine.py fails when an entry script has a flag without an entry here.
"""
from dataclasses import dataclass


class _Original:
    def __repr__(self):
        return "ORIGINAL"


ORIGINAL = _Original()  # `added` of a flag every run has recorded


@dataclass(frozen=True)
class Flag:
    resumable: bool = False
    added: object = ORIGINAL
    out: str = "tag"


RESUMABLE = Flag(resumable=True, out="never")
STEM = Flag(out="stem")

# The "value" flags name the default --out in this order (partition first: the heterogeneity study).
FLAGS = {
    # every entry script (engine/cli.py common_parser)
    "sorter": STEM, "seed": STEM, "lr": STEM, "B": STEM, "node_cnt": STEM,
    "partition": Flag(added={"LR-HMDA": "contiguous", "MLP-M4": "random"}, out="value"),  # LR-HMDA, MLP-M4
    "sync": Flag(added="every-step", out="value"),
    "reducer": Flag(added="dense", out="value"),
    "lr_schedule": Flag(added="step", out="value"),
    "momentum": Flag(), "weight_decay": Flag(),
    # not with a cosine / linear --lr-schedule, which is stretched over the run's epochs (changed_on_resume)
    "epochs": RESUMABLE,
    "data_dir": RESUMABLE, "out": RESUMABLE, "device": RESUMABLE, "backend": RESUMABLE,
    "tf32": Flag(added=False),
    "max_train_examples": Flag(), "max_eval_examples": Flag(),
    "resume": RESUMABLE, "overwrite": RESUMABLE, "record_orders": RESUMABLE, "progress": RESUMABLE,
    "unit_grads": Flag(out="never"),  # the per-unit gradient paths agree to float32 rounding
    "overlap": RESUMABLE,  # the same orders either way
    "sign_loop": RESUMABLE,  # CD-GraB's signs either way (a near-tie apart, like a BLAS dot's order)
    "compile": RESUMABLE,  # the same orders; with inductor losses to float32 rounding (engine/compiled.py)
    "log_herding": Flag(added=False, out="never"),  # adds a metrics.csv column
    "dist_timeout": RESUMABLE,
    "warmup_epochs": Flag(added=0.0), "min_lr": Flag(added=0.0),
    "H": Flag(added=4), "alpha": Flag(added=None), "H_base": Flag(added=4), "H_init": Flag(added=None),
    "power": Flag(added=2.0), "switch_epoch": Flag(added=None),
    "avg_m": Flag(added=False), "avg_v": Flag(added=False), "average_opt_state": Flag(added=False),
    "unit_grad_gather": Flag(resumable=True, added="round", out="never"),  # the same bytes and orders
    "density": Flag(added=None),
    "exact_low_memory": Flag(added="off", out="never"),  # the same orders, the update to float32 rounding
    "sketch_dim": Flag(added=0),  # -sketch-dim<D> in the default --out
    "sketch_min_numel": Flag(added=2**20),  # sorters/thresholds.py's engine row (no torch here: tests/test_sorters_imports.py checks)
    # main-LR-HMDA.py
    "hmda_file": Flag(),
    # main-MLP-M4.py
    "freq": Flag(), "in_len": Flag(), "hidden": Flag(), "layers": Flag(),
    # main-LSTM-Wiki2.py
    "bptt": Flag(), "clip": Flag(), "carry_hidden": Flag(), "order_unit": Flag(),
    "cudnn": Flag(resumable=True, added="on", out="never"),  # cuDNN's or PyTorch's kernels: float32 rounding apart
    # main-GPT2-Wiki103.py
    "train_file": Flag(), "max_seq_length": Flag(), "cache_dir": RESUMABLE,
    "grad_chunk": Flag(resumable=True, added="16", out="never"),  # blocks per gradient pass: float32 rounding apart
}

# a flag each benchmark's entry script has had from the start and no other has: which benchmark the args of
# a checkpoint that does not name it (one written before checkpoints did) came from
OWN_FLAGS = {"LR-HMDA": "hmda_file", "MLP-M4": "freq", "LSTM-Wiki2": "bptt", "GPT2-Wiki103": "max_seq_length"}
RESUMABLE_FLAGS = frozenset(name for name, flag in FLAGS.items() if flag.resumable)
NAMED_BY_VALUE = tuple(name for name, flag in FLAGS.items() if flag.out == "value")


def added_defaults(benchmark: str | None) -> dict:
    """{dest: value} that a config.json or checkpoint of `benchmark` without that flag ran with."""
    defaults = {}
    for name, flag in FLAGS.items():
        value = flag.added.get(benchmark, ORIGINAL) if isinstance(flag.added, dict) else flag.added
        if value is not ORIGINAL:
            defaults[name] = value
    return defaults


def with_added_defaults(args: dict, benchmark: str | None) -> dict:
    """args (a config.json's or checkpoint's) with the flags it predates filled in."""
    return {**added_defaults(benchmark), **args}


def changed_on_resume(saved: dict, now: dict, benchmark: str | None,
                      epochs_fixed: bool = False) -> list[tuple[str, object, object]]:
    """(dest, checkpoint's value, this run's value) of each setting that differs between a checkpoint's
    args `saved` and the resuming run's `now` and may not (sorted; a flag either predates counts as
    its `added` value). epochs_fixed: --epochs may not change either (a sorter whose thresholds
    depend on the run's length: KH-SGD, SBW)."""
    saved, now = with_added_defaults(saved, benchmark), with_added_defaults(now, benchmark)
    changed = sorted(key for key in (set(saved) | set(now)) - RESUMABLE_FLAGS if saved.get(key) != now.get(key))
    stretched = now.get("lr_schedule", "step") != "step"  # a cosine / linear schedule spans the run's epochs
    if (stretched or epochs_fixed) and saved.get("epochs") != now.get("epochs"):
        changed.append("epochs")
    return [(key, saved.get(key), now.get(key)) for key in changed]


def benchmark_of(args: dict) -> str | None:
    """The benchmark whose entry script made `args` (a checkpoint's), by the flags only it has; None if unknown."""
    found = [name for name, flag in OWN_FLAGS.items() if flag in args]
    return found[0] if len(found) == 1 else None
