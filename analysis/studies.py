"""The figures of the studies whose sweeps write into <results>/<study>/<benchmark>/<run>, each drawn from a
table analysis.aggregate.aggregate_all has already made:

    communication   scripts/sweep-communication.sh: synchronisation rule x reducer x sorter (issue #9)
    sketching       --sketch-dim: CD-GraB balancing CountSketches of the gradients (issue #20), or the
                    structured map (--sketch-min-numel: TensorSketch blocks for the layer weights, issue
                    #31); its training curves are drawn against the benchmark's own exact CD-GraB and D-RR runs
    reorderers      other coordinated reorderers (KH-SGD, SBW: issue #21), drawn against the
                    benchmark's CD-GraB and D-RR runs of the same settings
    leaderboard     every orderer with runs of the paper's settings (the benchmarks' own and the
                    reorderers study's, issue #60's orderers among them), one row per benchmark

`study_figures(tables)` returns {file stem: Figure} for every study present. The studies' tables
(communication_table, sketching_runs, herding_ratios, reorderer_runs, ...) are in analysis/aggregate.py.
"""
import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from analysis.aggregate import STRUCTURED
from analysis.style import (REDUCER_FILL, STRATEGY_MARKERS, metric_label, scale_value_axis, sketch_colours,
                            sketch_style, sorter_styles)


def plot_communication(table: pd.DataFrame, benchmark: str):
    """Final train loss and headline metric against the gigabytes communicated over the run (log x):
    colour = sorter, marker = synchronisation rule, hollow = ExDyna. table: aggregate.communication_table
    (Tables.communication). None without such runs."""
    if not len(table) or benchmark not in set(table["benchmark"]):
        return None
    table = table[table["benchmark"] == benchmark]
    metric = table["metric"].iloc[0]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    # colour: sorter; a sorter's settings (sync x reducer) have their own marker and fill instead
    colors = {sorter: style["color"] for sorter, style in sorter_styles(sorted(table["sorter"].unique())).items()}
    for ax, column, label in zip(axes, ("train_loss", "final"), ("final train loss", f"final {metric}")):
        for row in table.itertuples():
            ax.plot(row.gigabytes, getattr(row, column), linestyle="none", marker=STRATEGY_MARKERS.get(row.sync, "x"),
                    fillstyle=REDUCER_FILL.get(row.reducer, "full"), markersize=9,
                    color=colors[row.sorter], label=f"{row.sorter}, {row.sync}, {row.reducer}")
        ax.set_xscale("log")  # the strategies' bytes span orders of magnitude
        scale_value_axis([ax], table[column].to_list())
        ax.set_xlabel("gigabytes communicated over the run (sum over workers)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # outside: the points fill the panel
    seeds = int(table["seeds"].min())
    fig.suptitle(f"{benchmark}: example ordering x synchronisation x sparsification "
                 f"({int(table['epochs'].max())} epochs, {seeds} seed{'s' * (seeds > 1)})")
    fig.tight_layout()
    return fig


def plot_reorderers(curves: pd.DataFrame, benchmark: str):
    """Train loss and the benchmark's headline metric per epoch (mean over seeds, std band) of every
    sorter of the reorderers study and its baselines; one row of panels per number of workers. curves:
    aggregate.reorderer_curves (Tables.reorderers). None without reorderer runs."""
    curves = curves[curves["benchmark"] == benchmark] if len(curves) else curves
    if not len(curves):
        return None
    metrics = list(curves.sort_values("panel")["metric"].unique())
    worker_counts = sorted(curves["node_cnt"].unique())
    fig, axes = plt.subplots(len(worker_counts), len(metrics), figsize=(6 * len(metrics), 3.8 * len(worker_counts)),
                             squeeze=False)
    styles = sorter_styles(_in_order(curves, "sorter"))
    for row, n in zip(axes, worker_counts):
        for ax, metric in zip(row, metrics):
            _reorderer_panel(ax, curves[(curves["node_cnt"] == n) & (curves["metric"] == metric)], styles)
            title = f"{metric_label(metric, benchmark)}, {n} worker{'s' if n > 1 else ''}"
            ax.set_title(title + _late_range(ax, curves[curves["node_cnt"] == n], metric), fontsize=10)
            ax.set_xlabel("epoch")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    B, lr = int(curves["B"].iloc[0]), curves["lr"].iloc[0]
    fig.suptitle(f"{benchmark}: KH-SGD and SBW, coordinated, against CD-GraB and D-RR\n(B {B}, lr {lr:g}; "
                 f"band: std over seeds)", fontsize=11)
    fig.tight_layout()
    return fig


def _reorderer_panel(ax, curves, styles):
    """A curve and std band per sorter (in rank order) of one worker count's and metric's curves."""
    means = []
    for sorter in _in_order(curves, "sorter"):
        curve = curves[curves["sorter"] == sorter].sort_values("epoch")
        colour = styles[sorter]["color"]
        means += curve["mean"].to_list()
        ax.plot(curve["epoch"], curve["mean"], color=colour, linewidth=1.4,
                label=f"{sorter} ({int(curve['seeds'].iloc[0])} seeds)")
        ax.fill_between(curve["epoch"], curve["mean"] - curve["std"].fillna(0),
                        curve["mean"] + curve["std"].fillna(0), color=colour, alpha=0.12, linewidth=0)
    scale_value_axis([ax], means)


def _late_range(ax, curves, metric) -> str:
    """The train loss panel's y range: that of the sorters' mean curves in the later epochs (from 30% of
    the last on), where the sorters differ; returns the note the title adds (the first epochs leave the
    panel: say so, or the cut curves read as a drawing fault). Other metrics keep their range: ""."""
    if metric != "train_loss":
        return ""
    late = curves[(curves["metric"] == metric) & (curves["epoch"] >= curves["epoch"].max() * 0.3)]
    low, high = late["mean"].min(), late["mean"].max()
    ax.set_ylim(low - 0.1 * (high - low), high + 0.1 * (high - low))
    return f" (y range: epochs {int(late['epoch'].min())}-{int(curves['epoch'].max())})"


def plot_sketching(curves: pd.DataFrame, panels: pd.DataFrame, ratios: pd.DataFrame, benchmark: str):
    """The panels that have runs, of: the herding bound of the real gradients per epoch under each
    variant's orders (the runs with --log-herding); the train loss per epoch of those runs; the train loss
    per epoch on the full data; each mean over seeds with a std band, sketched (CountSketch solid, the
    structured map dashed with square markers) against exact CD-GraB and D-RR; and the herding bound of
    each sketched variant and of D-RR as a multiple of exact CD-GraB's of the same seed, seed by seed.
    curves, panels: aggregate.sketching_panels (Tables.sketching, Tables.sketching_panels); ratios:
    aggregate.herding_ratios without exact CD-GraB (Tables.sketching_ratios). None without sketching runs."""
    pick = [table[table["benchmark"] == benchmark] if len(table) else table for table in (curves, panels, ratios)]
    curves, panels, ratios = pick
    if not len(panels):
        return None
    count = len(panels) + bool(len(ratios))
    shape = (2, 2) if count == 4 else (1, count)
    fig, axes = plt.subplots(*shape, figsize=(6.5 * shape[1], 4.2 * shape[0]), squeeze=False)
    axes = axes.ravel()
    colours = sketch_colours(_in_order(pd.concat([curves, ratios]), "variant"))
    for ax, panel in zip(axes, panels.itertuples()):
        _sketching_panel(ax, curves[curves["panel"] == panel.panel], panel, colours)
    if len(ratios):
        plot_herding_ratios(axes[len(panels)], ratios, colours)
    for ax in axes[count:]:
        ax.set_visible(False)
    n, B = int(panels["n"].iloc[0]), int(panels["B"].iloc[0])
    fig.suptitle(f"{benchmark}: CD-GraB on D-dimensional gradient sketches (structured: TensorSketch blocks for the "
                 f"layer weights)\n({n} workers, B {B}; band: std over seeds)", fontsize=11)
    fig.tight_layout()
    return fig


def _sketching_panel(ax, curves, panel, colours):
    """One curve panel of plot_sketching: a curve and std band per variant; the y range that of the later
    epochs (the panel row's first, low and high), said in the title."""
    means = []
    for variant in _in_order(curves, "variant"):
        curve = curves[curves["variant"] == variant].sort_values("epoch")
        means += curve["mean"].to_list()
        style = sketch_style(variant, colours)
        ax.plot(curve["epoch"], curve["mean"], markersize=3.5, **style,
                label=f"{variant} ({int(curve['seeds'].iloc[0])} seeds)")
        ax.fill_between(curve["epoch"], curve["mean"] - curve["std"].fillna(0), curve["mean"] + curve["std"].fillna(0),
                        color=style["color"], alpha=0.08 if variant.endswith(STRUCTURED) else 0.12, linewidth=0)
    data = f"first {int(panel.examples):,} training examples" if panel.examples == panel.examples \
        else "the full training set"
    what = "herding bound of the real gradients" if panel.column == "herding_bound" else "train loss"
    ax.set_title(f"{what} ({data}, {panel.epochs} epochs)", fontsize=10)
    ax.set_xlabel("epoch")
    ax.set_ylabel("herding bound" if panel.column == "herding_bound" else "train loss")
    scale_value_axis([ax], means)
    if panel.epochs > panel.first:
        ax.set_ylim(panel.low - 0.05 * (panel.high - panel.low), panel.high + 0.05 * (panel.high - panel.low))
        ax.set_title(ax.get_title() + f"\n(y range: epochs {panel.first} on; the earlier ones above it)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_herding_ratios(ax, ratios: pd.DataFrame, colours: dict) -> None:
    """herding_ratios' per-seed ratios to exact CD-GraB (filled: mean over epochs 2 on; hollow: last
    epoch), one column per D (CountSketch circles on the left, the structured map's squares on the right)
    and one for D-RR, with the lines 1 (exact) and 1.25 (issue #31's goal). Each variant's points are one
    Line2D per statistic, labelled "<variant>: mean of epochs 2+" / "<variant>: last epoch"; the legend
    explains the markers instead of listing them."""
    # increasing D (D-RR's is NaN: last)
    bases = list(ratios.sort_values("dim", kind="stable")["variant"].str.removesuffix(STRUCTURED).unique())
    for variant in _in_order(ratios, "variant"):
        rows = ratios[ratios["variant"] == variant]
        style = sketch_style(variant, colours)
        shift = 0.0 if variant == "D-RR" else 0.15 if variant.endswith(STRUCTURED) else -0.15
        x = [bases.index(variant.removesuffix(STRUCTURED)) + shift] * len(rows)
        for column, fill, what in (("mean_ratio", "full", "mean of epochs 2+"), ("last_ratio", "none", "last epoch")):
            ax.plot(x, rows[column], linestyle="none", marker=style["marker"], color=style["color"], markersize=6,
                    fillstyle=fill, label=f"{variant}: {what}")
    exact = ax.axhline(1.0, color=colours["CD-GraB exact"], linewidth=1, label="exact CD-GraB")
    goal = ax.axhline(1.25, color="black", linewidth=1, linestyle=":", label="1.25x exact (issue #31 goal)")
    proxies = [Line2D([], [], linestyle="none", marker="o", color="gray", label="CountSketch"),
               Line2D([], [], linestyle="none", marker="s", color="gray", label="structured (TensorSketch blocks)"),
               Line2D([], [], linestyle="none", marker="o", color="gray", label="filled: mean of epochs 2+"),
               Line2D([], [], linestyle="none", marker="o", color="gray", fillstyle="none", label="hollow: last epoch"),
               exact, goal]
    ax.set_xticks(range(len(bases)), [b.replace("CD-GraB, ", "") for b in bases])
    ax.set_ylabel("herding bound / exact CD-GraB's (same seed)")
    ax.set_title("herding bound vs exact CD-GraB, seed by seed (colour: D)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(handles=proxies, fontsize=7, loc="best")


NEEDS_MARKERS = {"nothing": "o", "per-worker gradients": "s", "per-example gradients": "^"}


def plot_leaderboard(table: pd.DataFrame, curves: pd.DataFrame):
    """The leaderboard, one row of panels per benchmark: the train loss per epoch of every orderer (mean
    over seeds, std band; y range: the later epochs, where the orderers differ), then each orderer's final
    train loss and final headline metric (mean ± std over seeds as error bars, best train loss on top;
    marker: what the orderer needs, NEEDS_MARKERS; dotted line: D-RR's value). table, curves:
    aggregate.leaderboard (Tables.leaderboard, Tables.leaderboard_curves). None without runs."""
    if not len(table):
        return None
    benchmarks = sorted(table["benchmark"].unique())
    fig, axes = plt.subplots(len(benchmarks), 3, figsize=(18, 4.4 * len(benchmarks)), squeeze=False)
    for row, benchmark in zip(axes, benchmarks):
        rows = table[table["benchmark"] == benchmark].sort_values("rank")
        styles = sorter_styles(rows["sorter"])
        _leaderboard_curves(row[0], curves[curves["benchmark"] == benchmark], styles)
        row[0].set_title(f"{benchmark}: train loss (y range: epochs {max(2, int(rows['epoch'].max() * 0.3))} on)",
                         fontsize=10)
        for ax, column, label in ((row[1], "train_loss", "final train loss"),
                                  (row[2], "final", f"final {metric_label(rows['metric'].iloc[0], benchmark)}")):
            for y, entry in enumerate(rows.itertuples()):
                spread = getattr(entry, f"{column}_std")
                ax.errorbar(getattr(entry, column), -y, xerr=0 if spread != spread else spread, capsize=3,
                            marker=NEEDS_MARKERS.get(entry.needs, "x"), color=styles[entry.sorter]["color"],
                            linestyle="none", markersize=7)
            drr = rows.loc[rows["sorter"] == "D-RR", column]
            if len(drr):
                ax.axvline(drr.iloc[0], color="gray", linestyle=":", linewidth=1)
            ax.set_yticks([-y for y in range(len(rows))],
                          [f"{entry.sorter} ({entry.seeds} seed{'s' * (entry.seeds > 1)})" for entry in rows.itertuples()])
            ax.ticklabel_format(axis="x", style="plain", useOffset=False)
            ax.xaxis.set_major_locator(MaxNLocator(5))  # long plain labels: fewer of them
            ax.set_xlabel(f"{label} at epoch {int(rows['epoch'].max())} (mean ± std over seeds; dotted: D-RR)")
            ax.grid(alpha=0.3)
    proxies = [Line2D([], [], linestyle="none", marker=marker, color="gray", label=f"needs {needs}")
               for needs, marker in NEEDS_MARKERS.items()]
    axes[0][2].legend(handles=proxies, fontsize=8, loc="best")
    fig.suptitle("Every orderer on the paper's settings (best final train loss on top)", fontsize=11)
    fig.tight_layout()
    return fig


def _leaderboard_curves(ax, curves, styles):
    """The leaderboard's curve panel: a mean curve and std band per orderer, the y range that of the
    later epochs (from 30% of the last on, at least epoch 2)."""
    first = max(2, int(curves["epoch"].max() * 0.3))
    for sorter in _in_order(curves, "sorter"):
        curve = curves[curves["sorter"] == sorter].sort_values("epoch")
        colour = styles[sorter]["color"]
        ax.plot(curve["epoch"], curve["mean"], color=colour, linewidth=1.3, label=sorter)
        ax.fill_between(curve["epoch"], curve["mean"] - curve["std"].fillna(0), curve["mean"] + curve["std"].fillna(0),
                        color=colour, alpha=0.1, linewidth=0)
    late = curves[curves["epoch"] >= first]
    low, high = (late["mean"] - late["std"].fillna(0)).min(), (late["mean"] + late["std"].fillna(0)).max()
    ax.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))
    ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    ax.set_xlabel("epoch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def _in_order(table: pd.DataFrame, column: str) -> list:
    """The values of `column` in the order of the table's `rank` column (aggregate made it: variant_order,
    reorderer_order), so that drawing need not know the order."""
    return list(table.sort_values(["rank", column])[column].unique())


def study_figures(tables) -> dict:
    """{file stem: Figure} of every study in the tables (aggregate.aggregate_all)."""
    figs = {}
    for benchmark in sorted(tables.communication["benchmark"].unique()) if len(tables.communication) else []:
        figs[f"communication-{benchmark}"] = plot_communication(tables.communication, benchmark)
    for benchmark in sorted(tables.sketching_panels["benchmark"].unique()) if len(tables.sketching_panels) else []:
        figs[f"sketching-{benchmark}"] = plot_sketching(tables.sketching, tables.sketching_panels,
                                                        tables.sketching_ratios, benchmark)
    for benchmark in sorted(tables.reorderers["benchmark"].unique()) if len(tables.reorderers) else []:
        figs[f"reorderers-{benchmark}"] = plot_reorderers(tables.reorderers, benchmark)
    figs["leaderboard"] = plot_leaderboard(tables.leaderboard, tables.leaderboard_curves)
    return {name: fig for name, fig in figs.items() if fig is not None}
