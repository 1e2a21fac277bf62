"""Statistics over seeds (runs) and trials (herding simulation), as tidy long DataFrames: every table the
figures (analysis/plots.py, analysis/studies.py) and the printed tables need, made once by aggregate_all from
what analysis/load.py read. Nothing here draws, and nothing after this reads a run folder.

Read top to bottom: the statistics; the per-benchmark tables; the heterogeneity and scaling studies' final
values; the communication, sketching and reorderers studies; aggregate_all, which makes them all.
"""
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis.load import REPO_ROOT, RUN_COLUMNS, SETTING, load_configs
from analysis.paper_values import PAPER_SETTINGS, has_paper_settings

# The metric each benchmark's paper figure reports next to the train loss; the first available one
# is the table's "final metric". GPT-2 reports validation perplexity (test perplexity when present too).
HEADLINE = {
    "LR-HMDA": ["test_acc"],
    "LSTM-Wiki2": ["test_ppl"],
    "MLP-M4": ["test_smape"],
    "GPT2-Wiki103": ["valid_ppl", "test_ppl"],
}
BENCHMARKS = tuple(HEADLINE)
EXPECTED_SORTERS = ("CD-GraB", "D-RR")  # what the paper's figures compare
TIME_PARTS = ["sorter_seconds", "comm_seconds", "compute_seconds"]
GROUP = ["benchmark", "sorter", *SETTING]  # one curve per group
BANDS = ("std", "minmax")
STUDIES_WITH_FIGURES = ("communication", "sketching", "reorderers")  # studies with a figure of their own
STAT_COLUMNS = ["mean", "std", "min", "max", "count", "lo", "hi"]


def metric_columns(df: pd.DataFrame) -> list:
    """The numeric per-epoch columns of a load_runs frame (everything but the run keys and epoch)."""
    return [c for c in df.columns if c not in RUN_COLUMNS and c != "epoch" and pd.api.types.is_numeric_dtype(df[c])]


def available(df: pd.DataFrame, columns) -> list:
    """Those of `columns` that df has with at least one non-NaN value."""
    return [c for c in columns if c in df.columns and df[c].notna().any()]


def headline_metrics(df: pd.DataFrame, benchmark: str) -> list:
    """The benchmark's headline metric columns present in df (test_loss for an unknown benchmark)."""
    return available(df, HEADLINE.get(benchmark, ["test_loss"])) or available(df, ["test_loss"])


def std_over_seeds(values: pd.Series) -> float:
    """The population std (ddof 0), the paper's convention (its notebooks take numpy's std over the seed
    curves); NaN for a single value, so that a one-seed cell shows its mean alone."""
    return float(values.std(ddof=0)) if values.count() > 1 else float("nan")


def _stats(grouped, band: str) -> pd.DataFrame:
    """mean, std (std_over_seeds), min, max, count of a grouped Series, plus the band lo/hi: mean -/+ std
    (a single seed gives a zero-width band) or min/max."""
    if band not in BANDS:
        raise ValueError(f"band must be one of {BANDS}, got {band!r}")
    stats = grouped.agg(["mean", std_over_seeds, "min", "max", "count"]).rename(columns={"std_over_seeds": "std"})
    if band == "std":
        spread = stats["std"].fillna(0.0)
        stats["lo"], stats["hi"] = stats["mean"] - spread, stats["mean"] + spread
    else:
        stats["lo"], stats["hi"] = stats["min"], stats["max"]
    return stats


def aggregate(df: pd.DataFrame, metrics=None, band: str = "std", by=GROUP) -> pd.DataFrame:
    """Statistics over seeds per (by..., epoch, metric); by defaults to (benchmark, sorter, node_cnt, B,
    lr, setting): one curve per sorter and run setting.

    Returns a long DataFrame with columns *by, epoch, metric, mean, std, min, max, count, lo, hi,
    seconds; `seconds` is the mean over seeds of cum_seconds at that epoch (the x of the
    wall-clock plots). NaN values (a metric not evaluated that epoch) are left out of the counts.
    """
    by = list(by)
    metrics = metric_columns(df) if metrics is None else list(metrics)
    if df.empty or not metrics:
        return pd.DataFrame(columns=by + ["epoch", "metric"] + STAT_COLUMNS + ["seconds"])
    keys = by + ["epoch"]
    long = df.melt(id_vars=keys, value_vars=metrics, var_name="metric").dropna(subset=["value"])
    stats = _stats(long.groupby(keys + ["metric"], sort=True)["value"], band).reset_index()
    seconds = df.groupby(keys)["cum_seconds"].mean().rename("seconds").reset_index()
    return stats.merge(seconds, on=keys, how="left")


def final_values(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One row per run: its last non-NaN value of `metric` and that epoch. Columns RUN_COLUMNS, epoch, value."""
    rows = df.dropna(subset=[metric]).sort_values("epoch").groupby("run_dir", sort=False).tail(1)
    return rows[RUN_COLUMNS + ["epoch"]].assign(value=rows[metric]).reset_index(drop=True)


def final_table(df: pd.DataFrame) -> pd.DataFrame:
    """The headline metric at each run's last epoch, mean/std over seeds, per benchmark x sorter x setting.

    Columns: benchmark, sorter, node_cnt, B, lr, setting, metric, epoch (max final epoch), mean, std, seeds.
    """
    columns = GROUP + ["metric", "epoch", "mean", "std", "seeds"]
    parts = []
    for benchmark, bench in df.groupby("benchmark", sort=True):
        for metric in headline_metrics(bench, benchmark)[:1]:
            last = final_values(bench, metric)
            stats = last.groupby(GROUP).agg(epoch=("epoch", "max"), mean=("value", "mean"),
                                            std=("value", std_over_seeds), seeds=("seed", "nunique")).reset_index()
            parts.append(stats.assign(metric=metric)[columns])
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)


def time_breakdown(df: pd.DataFrame) -> pd.DataFrame:
    """Mean seconds per epoch (over epochs and seeds) of each phase, per benchmark x sorter x setting.

    Columns: *GROUP, sorter_seconds, comm_seconds, compute_seconds, other_seconds, epoch_seconds;
    other = epoch - (sorter + comm + compute), clipped at 0 (data loading, evaluation, logging).
    """
    parts = [c for c in TIME_PARTS if c in df.columns]
    if df.empty or "epoch_seconds" not in df.columns:
        return pd.DataFrame(columns=GROUP + TIME_PARTS + ["other_seconds", "epoch_seconds"])
    means = df.groupby(GROUP)[parts + ["epoch_seconds"]].mean().reset_index()
    for c in TIME_PARTS:
        if c not in means.columns:
            means[c] = 0.0
    means["other_seconds"] = (means["epoch_seconds"] - means[TIME_PARTS].fillna(0).sum(axis=1)).clip(lower=0)
    return means[GROUP + TIME_PARTS + ["other_seconds", "epoch_seconds"]]


def herding_vectors(n_workers: int, m: int) -> float:
    """The vectors of a herding simulation's trial, n_workers * m to 3 significant digits (the simulation's
    10^6 * --scale, less the remainder of its division by n): what tells its scales apart."""
    return float(f"{int(n_workers) * int(m):.3g}")


def aggregate_herding(hdf: pd.DataFrame, band: str = "std") -> pd.DataFrame:
    """Herding bound statistics over trials per (n_workers, m, method, round).

    Columns: n_workers, m, method, round, mean, std, min, max, count, lo, hi, vectors (herding_vectors: the
    scale of the simulation, so that runs of one n at two scales are never drawn or tabled as one).
    """
    keys = ["n_workers", "m", "method", "round"]
    if hdf.empty:
        return pd.DataFrame(columns=keys + STAT_COLUMNS + ["vectors"])
    agg = _stats(hdf.groupby(keys, sort=True)["bound"], band).reset_index()
    agg["vectors"] = [herding_vectors(n, m) for n, m in zip(agg["n_workers"], agg["m"])]
    return agg


def missing_sorters(df: pd.DataFrame, benchmarks=BENCHMARKS, sorters=EXPECTED_SORTERS) -> list:
    """Human-readable notes on expected (benchmark, sorter) pairs without any finished run."""
    notes = []
    for benchmark in benchmarks:
        have = set(df.loc[df["benchmark"] == benchmark, "sorter"]) if len(df) else set()
        if not have:
            notes.append(f"{benchmark}: no finished runs")
            continue
        notes += [f"{benchmark}: no finished runs of sorter {s}" for s in sorters if s not in have]
    return notes


# ------------------------------------------------------------------------------------------- the benchmarks
def paper_groups(df: pd.DataFrame) -> set:
    """The GROUP tuples (curves) of a load_runs frame whose runs all have the paper's settings of their
    benchmark (load_runs' paper_settings column; none when the frame lacks it)."""
    if df.empty or "paper_settings" not in df.columns:
        return set()
    flags = df.groupby(GROUP, sort=False)["paper_settings"].all()
    return {tuple(g) for g, ok in flags.items() if ok}


def benchmark_curves(df: pd.DataFrame, band: str = "std") -> pd.DataFrame:
    """The benchmark figures' curves: per benchmark of df, aggregate() of train_loss and its headline
    metrics (the figure's panels, in that order: `panel`), and `paper`: whether the curve's runs all have the
    paper's settings (paper_groups), the curves the paper's values are drawn beside."""
    parts = []
    for benchmark in sorted(df["benchmark"].unique()) if len(df) else []:
        bench = df[df["benchmark"] == benchmark]
        metrics = [m for m in ["train_loss"] + headline_metrics(bench, benchmark) if m in bench.columns]
        agg = aggregate(bench, metrics, band=band)
        paper = paper_groups(bench)
        agg["paper"] = [tuple(g) in paper for g in agg[GROUP].itertuples(index=False)]
        agg["panel"] = agg["metric"].map({m: i for i, m in enumerate(metrics)})
        parts.append(agg)
    columns = GROUP + ["epoch", "metric"] + STAT_COLUMNS + ["seconds", "paper", "panel"]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)


# ------------------------------------------------------------------------ final values vs partition, vs n
def partition_order(partition: str) -> tuple:
    """Sort key from least to most label skew: random, contiguous, dirichlet:ALPHA by falling ALPHA,
    label-sorted; anything else after them."""
    name, _, alpha = partition.partition(":")
    if name == "dirichlet":
        return (1, -float(alpha))
    return {"random": (0, 0), "contiguous": (0, 1), "label-sorted": (2, 0)}.get(name, (3, 0))


def study_groups(df: pd.DataFrame, column: str) -> list:
    """[(benchmark, study, runs)] for every benchmark and study whose runs take >= 2 values of `column`,
    studies with a figure of their own aside: the reorderers study's 1- and 4-worker runs at one batch are
    no worker-scaling series."""
    if df.empty or column not in df.columns:
        return []
    return [(benchmark, study, runs) for (benchmark, study), runs in df.groupby(["benchmark", "study"], sort=True)
            if runs[column].nunique() >= 2 and study not in STUDIES_WITH_FIGURES]


def final_points(df: pd.DataFrame, column: str) -> pd.DataFrame:
    """Each run's last train loss and headline metric, over seeds, against `column` ("partition" or
    "node_cnt"), per benchmark and study whose runs differ in it (study_groups).

    One row per (benchmark, study, metric, sorter, level: a value of `column`): mean, std (std_over_seeds),
    count, min, max of the runs' final values; position (the level's place on the x axis: partitions by
    partition_order, worker counts increasing); B (the global batch of the level's first run); last_epoch
    (the group's last epoch); panel (0: train loss, 1: the headline metric).
    """
    order_key = partition_order if column == "partition" else None
    parts = []
    for benchmark, study, runs in study_groups(df, column):
        order = sorted(runs[column].unique(), key=order_key)
        batches = runs.drop_duplicates(column).set_index(column)["B"]
        for panel, metric in enumerate(["train_loss"] + headline_metrics(runs, benchmark)[:1]):
            last = final_values(runs, metric)
            stats = last.groupby(["sorter", column])["value"].agg(["mean", std_over_seeds, "count", "min", "max"])
            stats = stats.rename(columns={"std_over_seeds": "std"}).reset_index().rename(columns={column: "level"})
            parts.append(stats.assign(benchmark=benchmark, study=study, metric=metric, panel=panel,
                                      position=stats["level"].map(order.index), B=stats["level"].map(batches),
                                      last_epoch=int(runs["epoch"].max())))
    columns = ["benchmark", "study", "panel", "metric", "sorter", "level", "position", "B", "last_epoch",
               "mean", "std", "count", "min", "max"]
    table = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)
    return table[columns].sort_values(["benchmark", "study", "panel", "sorter", "position"], ignore_index=True)


def herding_per_epoch(df: pd.DataFrame) -> pd.DataFrame:
    """The scaling figure's third panel: the logged herding bound per epoch, mean over seeds, per benchmark,
    study (those of study_groups(df, "node_cnt")), sorter and worker count n. Columns benchmark, study,
    sorter, node_cnt, epoch, mean. Groups without a logged bound have no rows."""
    parts = []
    for benchmark, study, runs in study_groups(df, "node_cnt"):
        if "herding_bound" in runs.columns and runs["herding_bound"].notna().any():
            agg = aggregate(runs, ["herding_bound"], by=["sorter", "node_cnt"])
            parts.append(agg[["sorter", "node_cnt", "epoch", "mean"]].assign(benchmark=benchmark, study=study))
    columns = ["benchmark", "study", "sorter", "node_cnt", "epoch", "mean"]
    return pd.concat(parts, ignore_index=True)[columns] if parts else pd.DataFrame(columns=columns)


# ------------------------------------------------------------------- the communication, sketching, reorderers
COMMUNICATION_ARGS = ["sync", "H", "alpha", "H_base", "reducer", "density", "lr_schedule"]
SYNC_ORDER = ("every-step", "constant", "qsr", "linear", "post-local")  # the table's order, the figure's markers


def config_args(configs: pd.DataFrame, names) -> pd.DataFrame:
    """run_dir and the config.json args `names` of each run of load_configs' table (None where a run
    lacks one)."""
    return pd.DataFrame([{"run_dir": run_dir, **{name: args.get(name) for name in names}}
                         for run_dir, args in zip(configs["run_dir"], configs["args"])], columns=["run_dir", *names])


def communication_table(df: pd.DataFrame, configs: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (benchmark, sorter, sync, reducer) of the communication study: the last epoch's
    train loss and headline metric (mean and population std over seeds, as the paper's notebooks), the bytes
    and averaging steps of the whole run (summed over epochs, mean over seeds), mean_H = the run's steps per averaging, the achieved density
    (mean over epochs), and the median seconds per epoch (over every epoch of every seed: robust to an epoch
    slowed by other work on a shared machine) with its ratio to every-step + dense of the same sorter.
    configs: load_configs of df (read here when not given)."""
    runs = df[df["study"] == "communication"] if len(df) else df
    if not len(runs):
        return pd.DataFrame()
    configs = load_configs(runs) if configs is None else configs
    runs = runs.merge(config_args(configs, COMMUNICATION_ARGS), on="run_dir", suffixes=("", "_arg"))
    rows = []
    for (benchmark, sorter, sync, reducer), group in runs.groupby(["benchmark", "sorter", "sync", "reducer"]):
        metric = headline_metrics(group, benchmark)[0]
        last = group[group["epoch"] == group.groupby("run_dir")["epoch"].transform("max")]
        steps = (group["syncs"] * group["mean_H"]).groupby(group["run_dir"]).sum()
        totals = group.groupby("run_dir")[["comm_bytes", "syncs"]].sum()
        rows.append({"benchmark": benchmark, "sorter": sorter, "sync": sync, "reducer": reducer,
                     "seeds": group["run_dir"].nunique(), "epochs": int(last["epoch"].max()),
                     "train_loss": last["train_loss"].mean(), "train_loss_std": last["train_loss"].std(ddof=0),
                     "metric": metric, "final": last[metric].mean(), "final_std": last[metric].std(ddof=0),
                     "gigabytes": totals["comm_bytes"].mean() / 1e9, "syncs": totals["syncs"].mean(),
                     "mean_H": (steps / totals["syncs"]).mean(), "density": group["density"].mean(),
                     "epoch_seconds": group["epoch_seconds"].median()})
    table = pd.DataFrame(rows)
    baseline = table[(table["sync"] == "every-step") & (table["reducer"] == "dense")].set_index(
        ["benchmark", "sorter"])["epoch_seconds"]
    table["seconds_vs_every_step"] = [row.epoch_seconds / baseline.get((row.benchmark, row.sorter), float("nan"))
                                      for row in table.itertuples()]
    order = {name: i for i, name in enumerate(SYNC_ORDER)}
    return table.sort_values(["benchmark", "sorter", "sync", "reducer"], key=lambda c: c.map(order) if c.name == "sync"
                             else c).reset_index(drop=True)


def _comparable(settings: dict) -> str:
    """A run's result-changing args without those a sketching baseline may differ in: the sorter, the seed,
    the sketch (its D and which weights are TensorSketch blocks) and the herding log (which does not change
    the run)."""
    return json.dumps({key: value for key, value in settings.items()
                       if key not in ("sorter", "seed", "sketch_dim", "sketch_min_numel", "log_herding")},
                      sort_keys=True, default=str)


def study_with_baselines(df: pd.DataFrame, study: str, configs: pd.DataFrame) -> pd.DataFrame:
    """The runs of `study` and, as their baselines, the exact CD-GraB and D-RR runs elsewhere (the
    benchmark's own runs, other studies) whose settings equal a group of the study's runs in everything
    but the sorter, seed and sketch (workers, batch, learning rate and schedule, data, synchronisation,
    ...), cut at that group's last epoch. df: a load_runs frame with the `sketch_dim` column of config_args;
    configs: its load_configs."""
    comparable = dict(zip(configs["run_dir"], configs["settings"].map(_comparable)))
    df = df.assign(comparable=df["run_dir"].map(comparable))
    runs = df[df["study"] == study]
    groups = runs.groupby("comparable")["epoch"].max().rename("last_epoch").reset_index()
    baselines = df[(df["study"] != study) & df["sorter"].isin(["CD-GraB", "D-RR"]) & (df["sketch_dim"] == 0)]
    baselines = baselines.merge(groups, on="comparable")
    baselines = baselines[baselines["epoch"] <= baselines["last_epoch"]].drop(columns="last_epoch")
    return pd.concat([runs, baselines], ignore_index=True).drop(columns="comparable")


STRUCTURED = ", structured"  # the variant suffix of a map with TensorSketch blocks


def variant_order(variant: str) -> tuple:
    """CD-GraB exact, then the sketches by decreasing D (the CountSketch before the structured map of the
    same D), then D-RR."""
    if variant == "CD-GraB exact":
        return (0, 0, 0)
    if variant.startswith("CD-GraB, D = "):
        structured = variant.endswith(STRUCTURED)
        return (1, -int(variant.removesuffix(STRUCTURED).rsplit(" ", 1)[1]), int(structured))
    return (2, 0, 0)


def study_rows(df: pd.DataFrame, benchmark: str, study: str, configs: pd.DataFrame | None):
    """(df's rows of `benchmark`, their configs) when they hold runs of `study`, else (no rows, None);
    configs: load_configs of df (read here when not given)."""
    df = df[df["benchmark"] == benchmark] if len(df) else df
    if not len(df) or not (df["study"] == study).any():
        return df.iloc[:0], None
    return df, load_configs(df) if configs is None else configs[configs["run_dir"].isin(df["run_dir"])]


def sketching_runs(df: pd.DataFrame, benchmark: str, configs: pd.DataFrame | None = None) -> pd.DataFrame:
    """The sketching study's runs of `benchmark` with their baselines (study_with_baselines). One row per
    (run, epoch), with `variant` ("D-RR", "CD-GraB exact", "CD-GraB, D = 64" for a plain CountSketch,
    "CD-GraB, D = 64, structured" for a map with TensorSketch blocks), `structured` (the map has blocks),
    `full_data` (no --max-train-examples) and `examples` (--max-train-examples, 0 for the full data).
    Empty without sketching runs. configs: load_configs of df (read here when not given)."""
    df, configs = study_rows(df, benchmark, "sketching", configs)
    if not len(df):
        return df
    df = df.merge(config_args(configs, ["sketch_dim", "max_train_examples"]), on="run_dir")
    df["examples"] = df["max_train_examples"].fillna(0)
    runs = study_with_baselines(df, "sketching", configs)
    runs["full_data"] = runs["examples"] == 0
    runs["structured"] = runs["run_dir"].map(dict(zip(configs["run_dir"], configs["blocks"].map(bool))))
    runs["variant"] = [sorter if sorter != "CD-GraB" else "CD-GraB exact" if not dim
                       else f"CD-GraB, D = {int(dim)}" + (STRUCTURED if structured else "")
                       for sorter, dim, structured in zip(runs["sorter"], runs["sketch_dim"].fillna(0),
                                                          runs["structured"])]
    return runs


def herding_ratios(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (examples, variant, seed) of sketching_runs' runs with a logged herding bound: the bound at the
    run's last epoch (`last`) and its mean over epochs 2 on (`mean`), and each divided by exact CD-GraB's of
    the same data and seed (`last_ratio`, `mean_ratio`: the same seed has the same data split, initial model
    and first order; NaN without that exact run). Empty without herding bounds."""
    columns = ["examples", "variant", "seed", "last", "mean", "last_ratio", "mean_ratio"]
    if not len(runs) or "herding_bound" not in runs or not runs["herding_bound"].notna().any():
        return pd.DataFrame(columns=columns)
    runs = runs[runs["herding_bound"].notna()]
    last = runs[runs["epoch"] == runs.groupby("run_dir")["epoch"].transform("max")]
    keys = ["examples", "variant", "seed"]
    table = last.groupby(keys)["herding_bound"].mean().rename("last").to_frame()
    table["mean"] = runs[runs["epoch"] >= 2].groupby(keys)["herding_bound"].mean()
    table = table.reset_index()
    exact = table[table["variant"] == "CD-GraB exact"].set_index(["examples", "seed"])[["last", "mean"]]
    for column in ("last", "mean"):
        table[f"{column}_ratio"] = [row[column] / exact[column].get((row["examples"], row["seed"]), float("nan"))
                                    for _, row in table.iterrows()]
    return table.sort_values(keys, key=lambda c: c.map(variant_order) if c.name == "variant" else c,
                             ignore_index=True)[columns]


def _curves(frame: pd.DataFrame, by: str, column: str) -> pd.DataFrame:
    """Per value of `by` and epoch: mean, std (std_over_seeds) and count of `column` over the runs, and
    `seeds`, the runs of that value of `by` (every epoch)."""
    curves = frame.groupby([by, "epoch"])[column].agg(["mean", std_over_seeds, "count"])
    curves = curves.rename(columns={"std_over_seeds": "std"}).reset_index()
    return curves.assign(seeds=curves[by].map(frame.groupby(by)["run_dir"].nunique()))


def variant_ranks(runs: pd.DataFrame) -> dict:
    """{variant: its place in variant_order among the variants of sketching_runs' `runs`}: the figure's
    order and colours follow it without sorting again."""
    return {variant: i for i, variant in enumerate(sorted(runs["variant"].unique(), key=variant_order))}


def sketch_dim(variant: str) -> float:
    """A sketched variant's D ("CD-GraB, D = 64, structured": 64); NaN for exact CD-GraB and D-RR."""
    return float(variant.removesuffix(STRUCTURED).rsplit(" ", 1)[1]) if variant.startswith("CD-GraB, D = ") \
        else float("nan")


def sketching_panels(runs: pd.DataFrame, benchmark: str) -> tuple:
    """The sketching figure's curve panels of sketching_runs' `runs`: (curves, panels).

    Panels, those with runs, in this order: the herding bound and the train loss of the runs with a logged
    herding bound, the train loss of the full-data runs. curves: per panel, variant and epoch, _curves'
    mean, std, count, seeds, and the variant's `rank` (variant_ranks). panels: one row per panel: column, examples (its --max-train-examples, NaN for
    the full data), epochs, first (the first epoch of its y range), low and high (that range: the later
    epochs' means ± their std over seeds: epoch 1's herding bound, the random first order, and the first
    epochs' losses would dwarf the differences between the variants), n and B (the figure's title)."""
    herding = runs[runs["herding_bound"].notna()] if "herding_bound" in runs else runs.iloc[:0]
    sources = [(frame, column) for frame, column in ((herding, "herding_bound"), (herding, "train_loss"),
                                                     (runs[runs["full_data"]], "train_loss")) if len(frame)]
    rank = variant_ranks(runs)
    curves, panels = [], []
    for panel, (frame, column) in enumerate(sources):
        curve = _curves(frame, "variant", column)
        curves.append(curve.assign(benchmark=benchmark, panel=panel, rank=curve["variant"].map(rank)))
        examples = frame["max_train_examples"].dropna()
        first = 2 if column == "herding_bound" else max(2, int(frame["epoch"].max() * 0.3))
        later = frame[frame["epoch"] >= first].groupby(["variant", "epoch"])[column]
        spread = later.agg(std_over_seeds).fillna(0)  # the bands' std, so that the range holds every band
        low, high = (later.mean() - spread).min(), (later.mean() + spread).max()
        panels.append({"benchmark": benchmark, "panel": panel, "column": column,
                       "examples": examples.iloc[0] if len(examples) else float("nan"),
                       "epochs": int(frame["epoch"].max()), "first": first, "low": low, "high": high,
                       "n": int(runs["node_cnt"].iloc[0]), "B": int(runs["B"].iloc[0])})
    return pd.concat(curves, ignore_index=True) if curves else pd.DataFrame(), pd.DataFrame(panels)


REORDERER_ORDER = ("CD-GraB", "KH-SGD", "SBW", "D-RR")


def reorderer_order(sorter: str) -> int:
    """CD-GraB, KH-SGD, SBW, D-RR, then any other sorter."""
    return REORDERER_ORDER.index(sorter) if sorter in REORDERER_ORDER else len(REORDERER_ORDER)


def reorderer_runs(df: pd.DataFrame, benchmark: str, configs: pd.DataFrame | None = None) -> pd.DataFrame:
    """The reorderers study's runs of `benchmark` with their CD-GraB and D-RR baselines
    (study_with_baselines): one row per (run, epoch). Empty without such runs. configs: load_configs of df
    (read here when not given)."""
    df, configs = study_rows(df, benchmark, "reorderers", configs)
    if not len(df):
        return df
    return study_with_baselines(df.merge(config_args(configs, ["sketch_dim"]), on="run_dir"), "reorderers", configs)


def reorderer_curves(runs: pd.DataFrame, benchmark: str) -> pd.DataFrame:
    """The reorderers figure's curves of reorderer_runs' `runs`: per worker count n (a row of panels), metric
    (train loss, the headline metric), sorter and epoch, _curves' mean, std, count, seeds; B and lr of the
    study's first run (the title); rank: the sorter's reorderer_order."""
    parts = []
    for panel, metric in enumerate(["train_loss", *headline_metrics(runs, benchmark)[:1]]):
        for n, group in runs.groupby("node_cnt", sort=True):
            parts.append(_curves(group, "sorter", metric).assign(node_cnt=n, metric=metric, panel=panel))
    table = pd.concat(parts, ignore_index=True)
    return table.assign(benchmark=benchmark, B=int(runs["B"].iloc[0]), lr=runs["lr"].iloc[0],
                        rank=table["sorter"].map(reorderer_order))


# ------------------------------------------------------------------------------------------- the leaderboard
# Issue #60's orderers: compared with every other orderer in the leaderboard; the benchmarks' paper-vs-ours
# tables and figures keep the paper's comparison (and their epoch times stay those of runs made alone).
LEADERBOARD_ONLY = ("FlipFlop", "SWR", "Greedy", "MB-GraB", "RPB")
# where runs with the paper's settings live (own folder first); "leaderboard": a leaderboard orderer's runs in
# a setting of its own (Greedy on MLP-M4 with --sketch-dim), kept out of the benchmark's folder, whose runs'
# curve labels name every setting in which they differ
LEADERBOARD_STUDIES = ("", "reorderers", "leaderboard")
NEEDS = ("nothing", "per-worker gradients", "per-example gradients")
# the side-by-side bench of every orderer (bench/epoch_time.py --record ... --label BENCHMARK): its seconds
# and peak memory ratios; a benchmark without a run there falls back to its runs' own logged seconds
LEADERBOARD_BENCH = REPO_ROOT / "bench" / "results" / "leaderboard-cpu.json"
TIME_SOURCES = ("bench", "runs' logs")


def gradients_needed(sorter: str) -> str:
    """What an orderer needs beyond plain training, read from its class in the library: "nothing" (it
    ignores gradients), "per-worker gradients" (its unit is a worker's micro-batch, whose gradient every
    data-parallel step computes anyway) or "per-example gradients"; "?" for a name the library lacks."""
    from sorters.registry import SORTERS  # here: reading runs needs no torch import

    cls = SORTERS.get(sorter.split(" (sketch ")[0])  # a sketched_name row: its sorter's class
    if cls is None:
        return "?"
    if not cls.uses_grads:
        return NEEDS[0]
    return NEEDS[1] if getattr(cls, "uses_batch_size", False) else NEEDS[2]


def leaderboard_bench(path=LEADERBOARD_BENCH) -> dict:
    """The recorded runs of a bench/epoch_time.py --record file, {label: run} (a run: its JSON object, with
    "seconds" {sorter spec: {"epoch_seconds": ...}} and, since the bench measures it, "peak_rss_mib" {sorter
    spec: MiB}); the leaderboard takes a benchmark's from the run labelled by its name. {} without the file."""
    path = Path(path)
    return json.loads(path.read_text()).get("runs", {}) if path.is_file() else {}


def bench_ratios(run: dict) -> pd.DataFrame:
    """Per sorter (the index: the name of a bench sorter spec NAME or NAME:ARGS), its median epoch seconds
    and peak memory in a recorded bench run over D-RR's in the same run: columns seconds_ratio,
    memory_ratio (NaN where the run lacks the sorter's or D-RR's value; memory: runs recorded before the
    bench measured it). A name given twice (two specs) keeps its first; a spec with --sketch-dim=D among its
    arguments is the row sketched_name(NAME, D), as leaderboard_runs names such runs."""
    def row_name(spec: str) -> str:  # NAME, or sketched_name for NAME:... --sketch-dim[=]D ...
        name, _, extra = spec.partition(":")
        words = shlex.split(extra)
        dims = [word.partition("=")[2] if "=" in word else (words[i + 1] if i + 1 < len(words) else "0")
                for i, word in enumerate(words) if word.partition("=")[0] == "--sketch-dim"]
        return sketched_name(name, int(dims[-1])) if dims and int(dims[-1]) else name

    def ratios(values: dict) -> dict:
        by_name = {}
        for spec, value in values.items():
            by_name.setdefault(row_name(spec), value)
        base = by_name.get("D-RR", float("nan"))
        return {name: value / base for name, value in by_name.items()}

    seconds = ratios({spec: row["epoch_seconds"] for spec, row in run.get("seconds", {}).items()})
    memory = ratios(run.get("peak_rss_mib", {}))
    table = pd.DataFrame({"seconds_ratio": pd.Series(seconds, dtype=float),
                          "memory_ratio": pd.Series(memory, dtype=float)})
    return table.rename_axis("sorter")


def sketched_name(sorter: str, sketch_dim: int) -> str:
    """The leaderboard's row of an orderer run on --sketch-dim D sketches of its gradients: "Greedy (sketch 64)"."""
    return f"{sorter} (sketch {sketch_dim})"


def _paper_settings_but_the_sketch(benchmark: str, args: dict) -> bool:
    """Whether a run with --sketch-dim D > 0 has its benchmark's paper settings in everything else (the sketch's
    own flags, sketch_dim and sketch_min_numel, set to the paper's)."""
    if not args.get("sketch_dim") or benchmark not in PAPER_SETTINGS:
        return False
    paper = PAPER_SETTINGS[benchmark]
    return has_paper_settings(benchmark, {**args, "sketch_dim": paper["sketch_dim"],
                                          "sketch_min_numel": paper["sketch_min_numel"]})


def leaderboard_runs(df: pd.DataFrame, configs: pd.DataFrame) -> pd.DataFrame:
    """The leaderboard's runs: every finished run (it reached its --epochs) with its benchmark's paper
    settings, from the benchmark's own folder or the reorderers study (LEADERBOARD_STUDIES); a (benchmark,
    sorter, seed) run in both counts once, the own folder's. A run whose only departure from the paper's
    settings is --sketch-dim D (an orderer whose exact form this CPU cannot afford there: Greedy on MLP-M4)
    is its own orderer, sketched_name's "SORTER (sketch D)". df: a load_runs frame; configs: its
    load_configs."""
    if not len(df) or "paper_settings" not in df.columns:
        return df.iloc[:0]
    args = dict(zip(configs["run_dir"], configs["args"]))
    benchmark_of = df.drop_duplicates("run_dir").set_index("run_dir")["benchmark"]
    sketched = {run: sketched_name(args[run]["sorter"], int(args[run]["sketch_dim"])) for run in benchmark_of.index
                if run in args and _paper_settings_but_the_sketch(benchmark_of[run], args[run])}
    if sketched:
        df = df.assign(sorter=df["run_dir"].map(sketched).fillna(df["sorter"]),
                       paper_settings=df["paper_settings"] | df["run_dir"].isin(sketched))
    runs = df[df["paper_settings"] & df["study"].isin(LEADERBOARD_STUDIES)]
    wanted = config_args(configs, ["epochs"]).set_index("run_dir")["epochs"]
    last = runs.groupby("run_dir")["epoch"].max()
    finished = [run for run, epoch in last.items() if epoch >= int(wanted.get(run) or 0) > 0]
    runs = runs[runs["run_dir"].isin(finished)]
    order = runs["study"].map({study: i for i, study in enumerate(LEADERBOARD_STUDIES)})
    first = runs.assign(order=order).sort_values(["order", "run_dir"]).drop_duplicates(["benchmark", "sorter", "seed"])
    return runs[runs["run_dir"].isin(first["run_dir"])]


def leaderboard(runs: pd.DataFrame, bench_runs: dict | None = None) -> tuple:
    """The leaderboard of leaderboard_runs' `runs`: (table, curves). bench_runs: leaderboard_bench's runs,
    {label: run}; a benchmark's bench run is the one labelled by its name (None or {}: none).

    table: one row per (benchmark, orderer), best final train loss first (`rank`): needs
    (gradients_needed), seeds (count) and seed_list, epoch (the runs' last), train_loss / train_loss_std
    and final / final_std (the headline `metric`) at that epoch, mean and population std over seeds
    (std_over_seeds: NaN for one seed); target: D-RR's final train loss (mean over its seeds); reaches: the
    first epoch at which the orderer's mean train loss over seeds is at most target (NaN: never, or no
    D-RR runs); seconds_ratio and memory_ratio: the orderer's seconds per epoch and peak memory over
    D-RR's, from the benchmark's bench run when `bench_runs` has one with D-RR in it (bench_ratios; NaN for an
    orderer it lacks), else seconds_ratio is the median seconds per epoch over every logged epoch of the
    orderer's runs over D-RR's (the runs' own logs, made at different times on a shared machine) and
    memory_ratio NaN (runs log no memory); time_source: which (TIME_SOURCES). curves: per benchmark,
    orderer and epoch, the train loss's mean and std over seeds and the orderer's rank (the figure's
    curves)."""
    tables, curves = [], []
    for benchmark, bench in runs.groupby("benchmark", sort=True) if len(runs) else []:
        metric = headline_metrics(bench, benchmark)[0]
        curve = _curves(bench, "sorter", "train_loss")
        last = bench[bench["epoch"] == bench.groupby("run_dir")["epoch"].transform("max")]
        rows = last.groupby("sorter").agg(seeds=("seed", "nunique"), epoch=("epoch", "max"),
                                          train_loss=("train_loss", "mean"), train_loss_std=("train_loss", std_over_seeds),
                                          final=(metric, "mean"), final_std=(metric, std_over_seeds)).reset_index()
        rows["seed_list"] = rows["sorter"].map(last.groupby("sorter")["seed"].agg(lambda s: sorted(int(v) for v in s)))
        measured = bench_ratios((bench_runs or {}).get(benchmark, {}))
        if measured["seconds_ratio"].get("D-RR", float("nan")) == 1.0:  # a bench run with D-RR's seconds
            rows["seconds_ratio"] = rows["sorter"].map(measured["seconds_ratio"])
            rows["memory_ratio"] = rows["sorter"].map(measured["memory_ratio"])
            rows["time_source"] = TIME_SOURCES[0]
        else:
            seconds = bench.groupby("sorter")["epoch_seconds"].median() if "epoch_seconds" in bench else pd.Series()
            rows["seconds_ratio"] = rows["sorter"].map(seconds / seconds.get("D-RR", float("nan")))
            rows["memory_ratio"] = float("nan")
            rows["time_source"] = TIME_SOURCES[1]
        target = rows.set_index("sorter")["train_loss"].get("D-RR", float("nan"))
        reached = curve[curve["mean"] <= target].groupby("sorter")["epoch"].min()
        rows = rows.assign(benchmark=benchmark, metric=metric, target=target, reaches=rows["sorter"].map(reached),
                           needs=rows["sorter"].map(gradients_needed))
        rows = rows.sort_values(["train_loss", "sorter"], ignore_index=True)
        rows["rank"] = range(len(rows))
        tables.append(rows)
        curves.append(curve.assign(benchmark=benchmark, rank=curve["sorter"].map(rows.set_index("sorter")["rank"])))
    columns = ["benchmark", "rank", "sorter", "needs", "seeds", "seed_list", "epoch", "train_loss", "train_loss_std",
               "metric", "final", "final_std", "target", "reaches", "seconds_ratio", "memory_ratio", "time_source"]
    table = pd.concat(tables, ignore_index=True)[columns] if tables else pd.DataFrame(columns=columns)
    return table, pd.concat(curves, ignore_index=True) if curves else pd.DataFrame()


# ------------------------------------------------------------------------------------------- all at once
@dataclass
class Tables:
    """Every table the figures and the final-metric table are drawn from (aggregate_all); plain DataFrames,
    each described by the function that makes it. `band` is what the curves' lo/hi columns are."""
    band: str
    curves: pd.DataFrame           # benchmark_curves of the benchmarks' own runs
    times: pd.DataFrame            # time_breakdown of the benchmarks' own runs
    herding: pd.DataFrame          # aggregate_herding of the herding simulation
    heterogeneity: pd.DataFrame    # final_points vs partition
    scaling: pd.DataFrame          # final_points vs node_cnt
    scaling_herding: pd.DataFrame  # herding_per_epoch
    communication: pd.DataFrame    # communication_table
    sketching: pd.DataFrame        # sketching_panels' curves, every benchmark
    sketching_panels: pd.DataFrame  # sketching_panels' panels, every benchmark
    sketching_ratios: pd.DataFrame  # herding_ratios of the sketched variants and D-RR; benchmark, rank, dim
    reorderers: pd.DataFrame       # reorderer_curves, every benchmark
    final: pd.DataFrame            # final_table of every run
    leaderboard: pd.DataFrame      # leaderboard's table, every benchmark
    leaderboard_curves: pd.DataFrame  # leaderboard's curves, every benchmark


def _sketching_tables(df: pd.DataFrame, configs: pd.DataFrame) -> tuple:
    """(curves, panels, ratios) of the sketching study, every benchmark with sketching runs."""
    curves, panels, ratios = [], [], []
    benchmarks = sorted(df.loc[df["study"] == "sketching", "benchmark"].unique()) if len(df) else []
    for benchmark in benchmarks:
        runs = sketching_runs(df, benchmark, configs)
        for parts, table in zip((curves, panels), sketching_panels(runs, benchmark)):
            parts.append(table)
        ratio = herding_ratios(runs)
        ratio = ratio[ratio["variant"] != "CD-GraB exact"].dropna(subset=["mean_ratio"])
        ratios.append(ratio.assign(benchmark=benchmark, rank=ratio["variant"].map(variant_ranks(runs)),
                                   dim=ratio["variant"].map(sketch_dim)))
    return tuple(pd.concat(parts, ignore_index=True) if parts else pd.DataFrame() for parts in (curves, panels, ratios))


def aggregate_all(df: pd.DataFrame, hdf: pd.DataFrame | None = None, configs: pd.DataFrame | None = None,
                  band: str = "std") -> Tables:
    """Every table of the figures and the final-metric table, from a load_runs frame, a load_herding frame
    (None: no herding simulation) and df's load_configs (read here when not given; python -m analysis reads
    it with the runs). band: "std" or "minmax", the curves' shaded band."""
    configs = load_configs(df) if configs is None else configs
    own = df[df["study"] == ""] if len(df) else df  # the benchmarks' own runs; studies get their own figures
    paper_comparison = own[~own["sorter"].isin(LEADERBOARD_ONLY)] if len(own) else own
    sketching, panels, ratios = _sketching_tables(df, configs)
    reorderers = [reorderer_curves(reorderer_runs(df, benchmark, configs), benchmark)
                  for benchmark in sorted(df.loc[df["study"] == "reorderers", "benchmark"].unique())] if len(df) else []
    board, board_curves = leaderboard(leaderboard_runs(df, configs), leaderboard_bench())
    return Tables(band=band, curves=benchmark_curves(paper_comparison, band), times=time_breakdown(paper_comparison),
                  herding=aggregate_herding(hdf if hdf is not None else pd.DataFrame(), band),
                  heterogeneity=final_points(df, "partition"), scaling=final_points(df, "node_cnt"),
                  scaling_herding=herding_per_epoch(df), communication=communication_table(df, configs),
                  sketching=sketching, sketching_panels=panels, sketching_ratios=ratios,
                  reorderers=pd.concat(reorderers, ignore_index=True) if reorderers else pd.DataFrame(),
                  final=final_table(df), leaderboard=board, leaderboard_curves=board_curves)
