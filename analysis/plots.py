"""The paper's figures from load_runs / load_herding frames. Every function returns a matplotlib
Figure (or None when there is nothing to draw); `draw_all` saves them as PNG and PDF:

    <out>/<benchmark>-vs-epoch.{png,pdf}        train loss + headline metric(s) vs epoch, band over seeds
    <out>/<benchmark>-vs-seconds.{png,pdf}      the same vs cumulative training seconds (mean over seeds)
    <out>/<benchmark>-time-breakdown.{png,pdf}  mean sorter/comm/compute/other seconds per epoch, stacked
    <out>/herding-bound.{png,pdf}               parallel herding bound per round (log y), one panel per n
    <out>/communication-<benchmark>.{png,pdf}   the communication study (analysis/studies.py)
    <out>/sketching-<benchmark>.{png,pdf}       the sketching study (analysis/studies.py)
    <out>/reorderers-<benchmark>.{png,pdf}      the reorderers study (analysis/studies.py)
    <out>/heterogeneity.{png,pdf}               final train loss and metric vs --partition (runs that differ in it)
    <out>/scaling.{png,pdf}                     final train loss and metric vs workers n, herding_bound per epoch

The benchmarks' own figures use the runs outside study folders (load_runs' `study` == ""); the
heterogeneity and scaling figures find their runs by what varies within one benchmark and study.

The caller picks the backend: `python -m analysis` uses Agg, notebooks their inline backend.
"""
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from analysis.aggregate import (GROUP, TIME_PARTS, aggregate, aggregate_herding, final_values, headline_metrics,
                                time_breakdown)
from analysis.paper_values import PAPER_VALUES, paper_epoch
from analysis.studies import study_figures
from analysis.style import SORTER_COLORS, metric_label as _label

PART_COLORS = {"sorter_seconds": "tab:red", "comm_seconds": "tab:blue", "compute_seconds": "tab:green",
               "other_seconds": "tab:gray"}
LOG_Y = ("_ppl",)  # perplexities span orders of magnitude in the first epochs
SECONDS_LABEL = "training seconds (cumulative; evaluation excluded)"  # what cum_seconds sums: epoch_seconds


def _curve_labels(groups):
    """{GROUP tuple: label}: the sorter name, plus the run setting that sets it apart from the
    benchmark's other runs (load_runs' `setting` column, e.g. "zero hidden state") when there is one."""
    labels = {}
    for g in groups:
        setting = dict(zip(GROUP, g))["setting"]
        labels[g] = f"{g[1]} ({setting})" if setting else g[1]
    return labels


def _color(sorter, i):
    return SORTER_COLORS.get(sorter, f"C{i % 10}")


def plot_benchmark(df, benchmark, x="epoch", band="std", metrics=None):
    """One panel per metric (train_loss + the headline metrics), one curve per sorter (x setting),
    mean over seeds with a shaded band. x: "epoch" or "seconds" (mean cumulative wall clock)."""
    if x not in ("epoch", "seconds"):
        raise ValueError(f"x must be 'epoch' or 'seconds', got {x!r}")
    bench = df[df["benchmark"] == benchmark]
    if bench.empty:
        return None
    metrics = metrics or [m for m in ["train_loss"] + headline_metrics(bench, benchmark) if m in bench.columns]
    agg = aggregate(bench, metrics, band=band)
    if agg.empty:
        return None
    groups = sorted({tuple(g) for g in agg[GROUP].itertuples(index=False)})
    labels = _curve_labels(groups)
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.8 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for i, g in enumerate(groups):
            rows = agg[(agg["metric"] == metric) & (agg[GROUP] == list(g)).all(axis=1)].sort_values("epoch")
            if rows.empty:
                continue
            xs, color = rows[x].to_numpy(float), _color(g[1], i)
            seeds = int(rows["count"].max())
            # markers: a one-epoch run is a single point, which a line alone does not draw
            ax.plot(xs, rows["mean"], color=color, marker="o", markersize=3,
                    label=f"{labels[g]} ({seeds} seed{'s' * (seeds > 1)})")
            ax.fill_between(xs, rows["lo"].to_numpy(float), rows["hi"].to_numpy(float), color=color, alpha=0.2, lw=0)
        if x == "epoch":
            _paper_points(ax, benchmark, metric)
        ax.set_xlabel("epoch" if x == "epoch" else SECONDS_LABEL)
        ax.set_ylabel(_label(metric, benchmark))
        if metric.endswith(LOG_Y):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    band_text = "mean ± 1 std" if band == "std" else "mean, min–max"
    fig.suptitle(f"{benchmark} vs {'epoch' if x == 'epoch' else 'training time'} ({band_text} over seeds)")
    fig.tight_layout()
    return fig


def _paper_points(ax, benchmark, metric):
    """The paper's reported value of this metric per sorter, as a star labelled "paper <sorter>"."""
    if benchmark not in PAPER_VALUES:
        return
    epoch, values = paper_epoch(benchmark), PAPER_VALUES[benchmark][1]  # LR-HMDA's epochs 49-50: at 49.5
    for i, (sorter, value) in enumerate(values.get(metric, {}).items()):
        ax.plot([epoch], [value], ls="none", marker="*", markersize=11, color=_color(sorter, i),
                markeredgecolor="black", markeredgewidth=0.6, label=f"paper {sorter} (epoch {epoch:g})")


def plot_time_breakdown(df, benchmark):
    """Stacked bars, one per sorter (x setting): mean seconds per epoch in sorter / communication /
    compute / other (epoch minus those three)."""
    times = time_breakdown(df[df["benchmark"] == benchmark])
    if times.empty:
        return None
    groups = [tuple(g) for g in times[GROUP].itertuples(index=False)]
    labels = _curve_labels(groups)
    fig, ax = plt.subplots(figsize=(1.6 * len(groups) + 2.4, 3.6))
    bottom = [0.0] * len(groups)
    for part in TIME_PARTS + ["other_seconds"]:
        heights = times[part].fillna(0).to_list()
        ax.bar([labels[g] for g in groups], heights, bottom=bottom, color=PART_COLORS[part],
               label=part.replace("_seconds", ""))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("seconds per epoch (mean)")
    ax.set_title(f"{benchmark}: time per epoch")
    handles, names = ax.get_legend_handles_labels()  # top of the stack first, outside the bars
    ax.legend(handles[::-1], names[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_herding(hdf, band="std"):
    """Parallel herding bound vs reorder round (log y), one panel per worker count, one curve per
    method, mean over trials with a band. Titles use the suite's letters (n workers, m units each; the
    paper swaps them)."""
    agg = aggregate_herding(hdf, band=band)
    if agg.empty:
        return None
    panels = sorted(agg[["n_workers", "m"]].drop_duplicates().itertuples(index=False))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4), squeeze=False, sharey=True)
    for ax, (n, m) in zip(axes[0], panels):
        panel = agg[(agg["n_workers"] == n) & (agg["m"] == m)]
        for i, method in enumerate(sorted(panel["method"].unique())):
            rows = panel[panel["method"] == method].sort_values("round")
            color = _color(method, i)
            # ALL (centralised, one sequence of n*m vectors) is a reference, not a parallel bound: dashed
            ax.plot(rows["round"], rows["mean"], marker=".", color=color, ls="--" if method == "ALL" else "-",
                    label="ALL (centralised)" if method == "ALL" else method)
            ax.fill_between(rows["round"].to_numpy(float), rows["lo"].to_numpy(float), rows["hi"].to_numpy(float),
                            color=color, alpha=0.2, lw=0)
        ax.set_yscale("log")
        ax.set_title(f"n={n} workers, m={m:g} units each", fontsize=9)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("parallel herding bound")
    handles = {}  # every method of every panel (a method may be missing from some)
    for ax in axes[0]:
        handles.update(zip(*reversed(ax.get_legend_handles_labels())))
    axes[0][-1].legend(handles.values(), handles.keys(), fontsize=8, loc="upper left",
                       bbox_to_anchor=(1.02, 1))  # outside: the curves fill the panels
    trials = int(agg["count"].max())
    fig.suptitle(f"Parallel herding bound of random unit vectors ({trials} trial{'s' * (trials > 1)})")
    fig.tight_layout()
    return fig


def partition_order(partition: str) -> tuple:
    """Sort key from least to most label skew: random, contiguous, dirichlet:ALPHA by falling ALPHA,
    label-sorted; anything else after them."""
    name, _, alpha = partition.partition(":")
    if name == "dirichlet":
        return (1, -float(alpha))
    return {"random": (0, 0), "contiguous": (0, 1), "label-sorted": (2, 0)}.get(name, (3, 0))


def _study_groups(df, column):
    """[(benchmark, study, runs)] for every benchmark and study whose runs take >= 2 values of `column`."""
    if df.empty or column not in df.columns:
        return []
    return [(benchmark, study, runs) for (benchmark, study), runs in df.groupby(["benchmark", "study"], sort=True)
            if runs[column].nunique() >= 2]


def _final_points(ax, runs, metric, column, order):
    """Mean ± std over seeds of each run's last `metric` value vs `column` (x positions from `order`,
    a list of its values), one line per sorter, sorters a little apart so the error bars do not overlap."""
    last = final_values(runs, metric)
    sorters = sorted(last["sorter"].unique())
    for i, sorter in enumerate(sorters):
        stats = last[last["sorter"] == sorter].groupby(column)["value"].agg(["mean", "std", "count"])
        stats = stats.reindex([v for v in order if v in stats.index])
        xs = [order.index(v) + 0.06 * (i - (len(sorters) - 1) / 2) for v in stats.index]
        seeds = int(stats["count"].max())
        ax.errorbar(xs, stats["mean"], yerr=stats["std"].fillna(0), marker="o", capsize=3, color=_color(sorter, i),
                    label=f"{sorter} ({seeds} seed{'s' * (seeds > 1)})")
    ax.set_ylabel(f"final {_label(metric, runs['benchmark'].iloc[0])}")
    ax.grid(alpha=0.3)


def plot_heterogeneity(df):
    """One row per benchmark and study whose runs differ in --partition: final train loss and final
    headline metric (mean ± std over seeds) against the partition, from least to most label skew."""
    groups = _study_groups(df, "partition")
    if not groups:
        return None
    fig, axes = plt.subplots(len(groups), 2, figsize=(10, 3.6 * len(groups)), squeeze=False)
    for row, (benchmark, study, runs) in zip(axes, groups):
        order = sorted(runs["partition"].unique(), key=partition_order)
        for ax, metric in zip(row, ["train_loss"] + headline_metrics(runs, benchmark)[:1]):
            _final_points(ax, runs, metric, "partition", order)
            ax.set_xticks(range(len(order)), order)
            ax.set_xlabel("--partition (label skew across workers grows to the right)")
        row[0].set_title(f"{benchmark}{f' ({study})' if study else ''}, epoch {int(runs['epoch'].max())}", fontsize=9)
        row[0].legend(fontsize=8)
    fig.suptitle("Heterogeneous workers: final values vs partition (mean ± 1 std over seeds)")
    fig.tight_layout()
    return fig


def plot_scaling(df):
    """One row per benchmark and study whose runs differ in the worker count n: final train loss and
    final headline metric vs n (log x), and, where logged, herding_bound per epoch (log y; colour: sorter,
    line style: n)."""
    groups = _study_groups(df, "node_cnt")
    if not groups:
        return None
    fig, axes = plt.subplots(len(groups), 3, figsize=(15, 3.6 * len(groups)), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for row, (benchmark, study, runs) in zip(axes, groups):
        order = sorted(runs["node_cnt"].unique())
        for ax, metric in zip(row, ["train_loss"] + headline_metrics(runs, benchmark)[:1]):
            _final_points(ax, runs, metric, "node_cnt", order)
            batches = runs.drop_duplicates("node_cnt").set_index("node_cnt")["B"]
            ax.set_xticks(range(len(order)), [f"n={n}\nB={batches[n]}" for n in order])
            ax.set_xlabel("workers n (global batch B)")
        row[0].set_title(f"{benchmark}{f' ({study})' if study else ''}, epoch {int(runs['epoch'].max())}", fontsize=9)
        row[0].legend(fontsize=8)
        ax = row[2]
        if "herding_bound" in runs.columns and runs["herding_bound"].notna().any():
            agg = aggregate(runs, ["herding_bound"], by=["sorter", "node_cnt"])
            for i, sorter in enumerate(sorted(agg["sorter"].unique())):
                for j, n in enumerate(order):
                    line = agg[(agg["sorter"] == sorter) & (agg["node_cnt"] == n)].sort_values("epoch")
                    if len(line):
                        ax.plot(line["epoch"], line["mean"], ls=styles[j % len(styles)], marker=".",
                                color=_color(sorter, i), label=f"{sorter}, n={n}")
            ax.set_yscale("log")
            ax.set_xlabel("epoch")
            ax.set_ylabel("herding bound (mean over seeds)")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7, ncol=2)
        else:
            ax.text(0.5, 0.5, "no herding_bound column\n(run with --log-herding)", ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_axis_off()
    fig.suptitle("Worker scaling, same batch per worker: final values vs n (mean ± 1 std over seeds)")
    fig.tight_layout()
    return fig


def save_figure(fig, out_dir, name) -> list:
    """Write fig as <out_dir>/<name>.png and .pdf; return the two paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.{ext}" for ext in ("png", "pdf")]
    for path in paths:
        fig.savefig(path, dpi=150, bbox_inches="tight")
    return paths


def benchmark_figures(df, benchmark, band="std") -> dict:
    """{file stem: Figure} of one benchmark (those with data)."""
    figs = {f"{benchmark}-vs-epoch": plot_benchmark(df, benchmark, "epoch", band),
            f"{benchmark}-vs-seconds": plot_benchmark(df, benchmark, "seconds", band),
            f"{benchmark}-time-breakdown": plot_time_breakdown(df, benchmark)}
    return {k: v for k, v in figs.items() if v is not None}


def draw_all(df, hdf, out_dir, band="std") -> list:
    """Save every figure the data allows into out_dir (closing each); return the written paths."""
    written = []
    figs = {}
    own = df[df["study"] == ""] if len(df) else df  # the benchmarks' own runs; studies get their own figures
    for benchmark in sorted(own["benchmark"].unique()) if len(own) else []:
        figs.update(benchmark_figures(own, benchmark, band))
    if hdf is not None and len(hdf):
        figs["herding-bound"] = plot_herding(hdf, band)
    figs["heterogeneity"] = plot_heterogeneity(df)
    figs["scaling"] = plot_scaling(df)
    figs.update(study_figures(df))
    for name, fig in figs.items():
        if fig is not None:
            written += save_figure(fig, out_dir, name)
            plt.close(fig)
    return written
