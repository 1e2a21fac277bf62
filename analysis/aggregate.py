"""Statistics over seeds (runs) and trials (herding simulation), as tidy long DataFrames."""
import pandas as pd

from analysis.load import RUN_COLUMNS, SETTING

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


def aggregate_herding(hdf: pd.DataFrame, band: str = "std") -> pd.DataFrame:
    """Herding bound statistics over trials per (n_workers, m, method, round).

    Columns: n_workers, m, method, round, mean, std, min, max, count, lo, hi.
    """
    keys = ["n_workers", "m", "method", "round"]
    if hdf.empty:
        return pd.DataFrame(columns=keys + STAT_COLUMNS)
    return _stats(hdf.groupby(keys, sort=True)["bound"], band).reset_index()


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
