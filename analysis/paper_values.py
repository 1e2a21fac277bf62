"""The paper's reported values (read off its figures) and the settings they were measured with, in one
place: the figures draw the values beside runs with those settings (analysis/plots.py) and the
paper-vs-ours tables print them (scripts/reproduction_tables.py)."""
import math

# benchmark -> (the epochs the paper's value is the mean of, {metric: {sorter: value}}); LR-HMDA's are the
# mean of epochs 49 and 50
PAPER_VALUES = {
    "LR-HMDA": ((49, 50), {"train_loss": {"CD-GraB": 0.33546, "D-RR": 0.33724},
                           "test_acc": {"CD-GraB": 0.82371, "D-RR": 0.82279}}),
    "LSTM-Wiki2": ((50,), {"train_loss": {"CD-GraB": 5.311, "D-RR": 5.361},
                           "test_ppl": {"CD-GraB": 223.6, "D-RR": 231.9}}),
    "MLP-M4": ((30,), {"train_loss": {"CD-GraB": 0.0905, "D-RR": 0.0920},
                       "test_smape": {"CD-GraB": 8.51, "D-RR": 8.86}}),
    "GPT2-Wiki103": ((30,), {"train_loss": {"CD-GraB": 4.098, "D-RR": 4.105}}),
}
# the herding simulation (scripts/herding_simulation.py): bound at the last round per method, for n = 5, 10, 20, 50,
# 100 workers
PAPER_HERDING = {"CD-GraB": "2.3-2.7 for every n", "I-B": "4.2, 5.8, 8.5, 12.5, 17.7", "I-PB": "6, 8.5, 12, 18, 24"}

# The paper's settings of each benchmark: every config.json argument that changes a run's results
# (engine/flags.py: neither resumable nor "never" in the run name), sorter and seed aside, as
# scripts/sweep-<benchmark>.sh runs them when the data are complete. tests/test_figures.py checks this
# table against the sweeps' commands as the entry scripts parse them, so a new flag or a changed sweep
# default shows up there. The run length (--epochs) is no setting here: see has_paper_settings.
# sketch_min_numel: sorters/thresholds.py's engine row, written out (importing sorters imports torch);
# tests/test_sorters_imports.py checks the two agree.
_COMMON = {"momentum": 0.9, "weight_decay": 0.0, "tf32": False, "max_train_examples": None,
           "max_eval_examples": None, "sketch_dim": 0, "sketch_min_numel": 2**20, "lr_schedule": "step", "warmup_epochs": 0.0, "min_lr": 0.0,
           "sync": "every-step", "H": 4, "alpha": None, "H_base": 4, "H_init": None, "power": 2.0,
           "switch_epoch": None, "avg_m": False, "avg_v": False, "average_opt_state": False, "reducer": "dense",
           "density": None}
PAPER_SETTINGS = {
    "LR-HMDA": {**_COMMON, "lr": 5e-3, "node_cnt": 4, "B": 16, "hmda_file": None, "partition": "contiguous"},
    # clipped to 0.25 as the original code was at the paper's time (its HEAD does not clip; REPRODUCTION.md)
    "LSTM-Wiki2": {**_COMMON, "lr": 5.0, "node_cnt": 4, "B": 16, "bptt": 35, "clip": 0.25, "carry_hidden": True,
                   "order_unit": "chunk"},
    # the paper's figure (the authors' M4 notebook), not the original README's 32 workers and B 32
    "MLP-M4": {**_COMMON, "lr": 1e-3, "node_cnt": 4, "B": 16, "freq": "Weekly", "in_len": 20, "hidden": 64,
               "layers": 3, "partition": "random"},
    # the real WikiText-103 train split: a run on the WikiText-2 stand-in (--train-file) trains on another,
    # far smaller set, so its losses are not the paper's quantity
    "GPT2-Wiki103": {**_COMMON, "lr": 5e-4, "node_cnt": 64, "B": 64, "train_file": None, "max_seq_length": 128},
}


def paper_epoch(benchmark: str) -> float:
    """Where a figure draws the paper's values of `benchmark`: the mean of the epochs they average."""
    epochs = PAPER_VALUES[benchmark][0]
    return sum(epochs) / len(epochs)


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):  # a learning rate read back from JSON
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool) and math.isclose(a, b, rel_tol=1e-9)
    return a == b


def has_paper_settings(benchmark: str, args: dict) -> bool:
    """Whether a run (its config.json args, with the values engine/flags.py gives the flags it predates)
    has the paper's settings of `benchmark` (PAPER_SETTINGS) and is set to run at least to the epoch of
    the paper's values: its step learning-rate schedule does not depend on --epochs, so a longer run
    passes that epoch on the same path, while a shorter one (a smoke run) never gets there. An argument
    the run lacks counts as different."""
    if benchmark not in PAPER_SETTINGS or benchmark not in PAPER_VALUES:
        return False
    missing = object()
    if any(not _same(args.get(key, missing), value) for key, value in PAPER_SETTINGS[benchmark].items()):
        return False
    try:
        return int(args["epochs"]) >= max(PAPER_VALUES[benchmark][0])
    except (KeyError, TypeError, ValueError):
        return False
