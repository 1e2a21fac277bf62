"""Read finished runs (config.json + metrics.csv) and the herding simulation CSVs into tidy DataFrames.

A run directory holds
    config.json  {"benchmark": ..., "args": {"sorter", "seed", "lr", "B", "node_cnt", "epochs", ...}, "sizes": ...}
    metrics.csv  one row per finished epoch: epoch,train_loss,test_loss,<benchmark columns>,
                 epoch_seconds,sorter_seconds,comm_seconds,compute_seconds,comm_bytes
and is finished when metrics.csv has args.epochs rows.

A run's identity is its benchmark and every argument that may change its results: all of
config.json's args except those that may change on resume (engine/flags.py). Runs of one benchmark and sorter whose settings differ
(--carry-hidden, --clip, --node_cnt, --max-train-examples, ...) are different curves, labelled by the
`setting` column: the arguments that differ between the benchmark's runs, sorter and seed aside.

Runs of a study (scripts/sweep-heterogeneity.sh, scripts/sweep-scaling.sh) live under a folder named
after it, <root>/<study>/<benchmark>/<run>: the `study` column holds the path between the results
folder and the benchmark folder ("" for the benchmarks' own runs), settings are compared within one
study, and a study's setting labels start with its name ("heterogeneity: partition=random").
An argument that older runs lack counts as the value they ran with (engine/flags.py), so they match newer runs.
"""
import json
import warnings
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from analysis.paper_values import has_paper_settings
from engine.flags import RESUMABLE_FLAGS, with_added_defaults  # plain Python: no torch for the notebooks

RUN_COLUMNS = ["benchmark", "sorter", "seed", "node_cnt", "B", "lr", "setting", "run_dir", "partition", "study",
               "paper_settings"]
SETTING = ["node_cnt", "B", "lr", "setting"]  # runs of one benchmark and sorter that differ here are different curves
# args that may differ on resume never change a run's results
RESUMABLE_ARGS = RESUMABLE_FLAGS
NOT_SETTINGS = RESUMABLE_ARGS | {"sorter", "seed"}  # what a setting label leaves out
# how a differing argument is shown in a setting label; others as name=value
SHORT_NAMES = {"node_cnt": "n"}
VALUE_LABELS = {"carry_hidden": {True: "carried hidden state", False: "zero hidden state"}}
# settings whose values read better as words in a legend (None: the whole split, not "=None")
WORD_LABELS = {"max_train_examples": lambda v: "all training units" if v is None else f"first {v} training units",
               "max_eval_examples": lambda v: "all evaluation units" if v is None else f"first {v} evaluation units"}
HERDING_COLUMNS = ["n_workers", "m", "d", "trial", "method", "round", "bound"]


class Problem(NamedTuple):
    """A run directory (or file) that was skipped or only partly used, and why."""
    path: str
    reason: str

    def __str__(self):
        return f"{self.path}: {self.reason}"


def _study(run_dir: Path, results_dir: Path, benchmark: str) -> str:
    """The folders between results_dir and the benchmark's folder ("" when none or no benchmark folder)."""
    parts = run_dir.relative_to(results_dir).parts[:-1]
    return "/".join(parts[:parts.index(benchmark)]) if benchmark in parts else ""


def result_settings(config: dict) -> dict:
    """A run's result-changing args from its parsed config.json: every arg but those that may change on
    resume (engine/flags.py), with the values engine/flags.py gives the flags the run predates."""
    args = with_added_defaults(config["args"], config["benchmark"])
    return {key: value for key, value in args.items() if key not in RESUMABLE_ARGS}


def _read_run(run_dir: Path, results_dir: Path, include_incomplete: bool):
    """(DataFrame of this run's epochs, problem or None); raises ValueError when unusable."""
    try:
        config = json.loads((run_dir / "config.json").read_text())
        args = config["args"]
        benchmark = config["benchmark"]
        args = with_added_defaults(args, benchmark)  # a config.json from before a flag existed
        info = {"benchmark": benchmark, "sorter": args["sorter"], "seed": int(args["seed"]),
                "node_cnt": int(args["node_cnt"]), "B": int(args["B"]), "lr": float(args["lr"]),
                "setting": "", "run_dir": str(run_dir), "partition": args.get("partition") or "",
                "study": _study(run_dir, results_dir, benchmark),
                "paper_settings": has_paper_settings(benchmark, args)}
        epochs = int(args["epochs"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"unreadable config.json ({type(e).__name__}: {e})") from None
    try:
        metrics = pd.read_csv(run_dir / "metrics.csv")
    except (OSError, ValueError) as e:  # EmptyDataError and ParserError are ValueErrors
        raise ValueError(f"unreadable metrics.csv ({type(e).__name__}: {e})") from None
    if "epoch" not in metrics.columns or "epoch_seconds" not in metrics.columns:
        raise ValueError(f"metrics.csv lacks epoch/epoch_seconds columns (has {list(metrics.columns)})")
    metrics = metrics.apply(pd.to_numeric, errors="coerce")  # a garbled cell becomes NaN, not a crash
    if metrics["epoch"].isna().any():
        raise ValueError("metrics.csv has rows without an epoch number")
    metrics = metrics.sort_values("epoch").reset_index(drop=True)
    if len(metrics) == 0:
        raise ValueError(f"incomplete: 0/{epochs} epochs")
    problem = None
    if len(metrics) < epochs:
        problem = f"incomplete: {len(metrics)}/{epochs} epochs"
        if not include_incomplete:
            raise ValueError(problem)
    metrics["cum_seconds"] = metrics["epoch_seconds"].cumsum()
    for key, value in reversed(list(info.items())):
        metrics.insert(0, key, value)
    return metrics, result_settings(config), problem


def run_key(benchmark: str, settings: dict) -> str:
    """One string per distinct experiment: the benchmark and its result-changing args (seed included)."""
    return json.dumps([benchmark, settings], sort_keys=True, default=str)


def setting_labels(settings: list[dict]) -> list[str]:
    """For runs of one benchmark (their result-changing args), a label each naming the args, sorter and
    seed aside, whose values differ between the runs: "" when none do, else e.g. "n=4, B=16" or
    "zero hidden state". An arg missing from a run's config counts as None."""
    keys = sorted({k for s in settings for k in s} - NOT_SETTINGS)
    differing = [k for k in keys if len({json.dumps(s.get(k), default=str) for s in settings}) > 1]
    return [", ".join(_show(k, s.get(k)) for k in differing) for s in settings]


def _show(key, value) -> str:
    if value in VALUE_LABELS.get(key, {}):
        return VALUE_LABELS[key][value]
    if key in WORD_LABELS:
        return WORD_LABELS[key](value)
    if value is None:  # an optional setting left unset ("clip=None" reads like a value)
        return f"{SHORT_NAMES.get(key, key)} unset"
    if isinstance(value, float):
        value = f"{value:g}"
    return f"{SHORT_NAMES.get(key, key)}={value}"


def load_runs(results_dir, include_incomplete: bool = False, with_problems: bool = False, warn: bool = True):
    """Every run under results_dir (searched recursively) as one tidy DataFrame, one row per (run, epoch).

    Columns: benchmark, sorter, seed, node_cnt, B, lr, setting, run_dir, partition ("" where the
    benchmark has none), study, paper_settings (the run has the paper's settings of its benchmark:
    analysis.paper_values.has_paper_settings), epoch, <every metrics.csv column>, cum_seconds (running
    sum of epoch_seconds within the run). Columns a benchmark lacks are NaN. `setting` labels what sets the
    run apart from the other runs of its benchmark and study (setting_labels).

    Runs that cannot be read, or are unfinished (fewer rows than args.epochs; kept when
    include_incomplete), or repeat an already loaded run (same benchmark and args, resumable ones
    aside: run_key), are skipped and reported: as warnings (warn) and as a list of Problem when
    with_problems, in which case the return value is (DataFrame, problems). Never raises for a bad run.
    """
    results_dir = Path(results_dir)
    frames, settings, problems, seen = [], [], [], {}
    run_dirs = sorted({p.parent for p in results_dir.rglob("config.json")} |
                      {p.parent for p in results_dir.rglob("metrics.csv")}) if results_dir.is_dir() else []
    if not results_dir.is_dir():
        problems.append(Problem(str(results_dir), "results directory does not exist"))
    for run_dir in run_dirs:
        try:
            frame, run_settings, problem = _read_run(run_dir, results_dir, include_incomplete)
        except ValueError as e:
            problems.append(Problem(str(run_dir), str(e)))
            continue
        key = run_key(frame.loc[0, "benchmark"], run_settings)  # a study's run repeating another is a duplicate too
        if key in seen:
            problems.append(Problem(str(run_dir), f"duplicate of {seen[key]} (same benchmark, seed and "
                                                  "settings); skipped"))
            continue
        seen[key] = str(run_dir)
        if problem:
            problems.append(Problem(str(run_dir), problem + " (included)"))
        frames.append(frame)
        settings.append(run_settings)
    for benchmark, study in {(frame.loc[0, "benchmark"], frame.loc[0, "study"]) for frame in frames}:
        mine = [i for i, frame in enumerate(frames)
                if (frame.loc[0, "benchmark"], frame.loc[0, "study"]) == (benchmark, study)]
        for i, label in zip(mine, setting_labels([settings[i] for i in mine])):
            frames[i]["setting"] = f"{study}: {label}" if study and label else study or label
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=RUN_COLUMNS + ["epoch", "cum_seconds"])
    # metrics columns in first-seen order, cum_seconds last
    ordered = RUN_COLUMNS + [c for c in df.columns if c not in RUN_COLUMNS and c != "cum_seconds"] + ["cum_seconds"]
    df = df[ordered]
    if warn:
        for problem in problems:
            warnings.warn(f"skipped run: {problem}", stacklevel=2)
    return (df, problems) if with_problems else df


def sketch_blocks(config: dict) -> list:
    """The TensorSketch blocks [offset, rows, cols] of a run's map, as its parsed config.json records them
    (`sorter.sketch.blocks`; [] for a plain CountSketch, exact CD-GraB, D-RR, or a run from before
    --sketch-min-numel)."""
    return list((config.get("sorter") or {}).get("sketch", {}).get("blocks") or [])


def load_configs(df) -> pd.DataFrame:
    """One row per run of a load_runs frame: what the tables need from its config.json beyond the
    load_runs columns, read once here so that no table or figure opens a run folder again.

    Columns: run_dir; args (dict: every config.json arg, with the values engine/flags.py gives the flags the
    run predates); settings (dict: result_settings, the result-changing args); blocks (sketch_blocks).
    """
    rows = []
    for run_dir in df["run_dir"].unique() if len(df) else []:
        config = json.loads((Path(run_dir) / "config.json").read_text())
        rows.append({"run_dir": run_dir, "args": with_added_defaults(config["args"], config["benchmark"]),
                     "settings": result_settings(config), "blocks": sketch_blocks(config)})
    return pd.DataFrame(rows, columns=["run_dir", "args", "settings", "blocks"])


def load_herding(herding_dir, with_problems: bool = False, warn: bool = True):
    """All herding simulation CSVs (scripts/herding_simulation.py) under herding_dir as one DataFrame.

    Columns: n_workers, m, d, trial, method, round, bound (+ seconds when present), one row per
    (n_workers, m, trial, method, round): runs of one n at two scales (--scale: another m) are both kept.
    Files without these columns are skipped and reported.
    """
    herding_dir = Path(herding_dir)
    frames, problems = [], []
    paths = sorted(herding_dir.rglob("*.csv")) if herding_dir.is_dir() else []
    if not herding_dir.is_dir():
        problems.append(Problem(str(herding_dir), "herding directory does not exist"))
    for path in paths:
        try:
            frame = pd.read_csv(path)
        except (OSError, ValueError) as e:
            problems.append(Problem(str(path), f"unreadable ({type(e).__name__}: {e})"))
            continue
        missing = [c for c in HERDING_COLUMNS if c not in frame.columns]
        if missing:
            problems.append(Problem(str(path), f"not a herding CSV: missing columns {missing}"))
            continue
        frames.append(frame)
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=HERDING_COLUMNS)
    if len(df):
        df = df.drop_duplicates(["n_workers", "m", "trial", "method", "round"]).sort_values(
            ["n_workers", "m", "method", "trial", "round"]).reset_index(drop=True)
    if warn:
        for problem in problems:
            warnings.warn(f"skipped herding file: {problem}", stacklevel=2)
    return (df, problems) if with_problems else df


REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_RESULTS = REPO_ROOT / "reproduction"  # the full-scale runs shipped with the suite (config + metrics only)


def default_results_dir() -> Path:
    """The user's own results/ (repo root) when it holds at least one run, else the shipped
    reproduction/ runs, so figures and notebooks show the reproduction out of the box."""
    own = REPO_ROOT / "results"
    if own.is_dir() and any(own.rglob("config.json")):
        return own
    return SHIPPED_RESULTS
