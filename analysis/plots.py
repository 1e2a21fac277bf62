"""The paper's figures, each drawn from a table analysis.aggregate.aggregate_all has already made (the
runs are read once by analysis/load.py, aggregated once by analysis/aggregate.py; nothing here reads a run
folder or computes a statistic over seeds). Every function returns a matplotlib Figure (or None when there
is nothing to draw); `draw_all` saves them as PNG and PDF:

    <out>/<benchmark>-vs-epoch.{png,pdf}        train loss + headline metric(s) vs epoch, band over seeds
    <out>/<benchmark>-vs-seconds.{png,pdf}      the same vs cumulative training seconds (mean over seeds)
    <out>/<benchmark>-time-breakdown.{png,pdf}  mean sorter/comm/compute/other seconds per epoch, stacked
    <out>/herding-bound.{png,pdf}               parallel herding bound per round, one panel per n (row: scale)
    <out>/herding-bound-orderers.{png,pdf}      the same for issue #60's orderers beside CD-GraB and D-RR
    <out>/communication-<benchmark>.{png,pdf}   the communication study (analysis/studies.py)
    <out>/sketching-<benchmark>.{png,pdf}       the sketching study (analysis/studies.py)
    <out>/reorderers-<benchmark>.{png,pdf}      the reorderers study (analysis/studies.py)
    <out>/leaderboard.{png,pdf}                 every orderer on the paper's settings (analysis/studies.py)
    <out>/heterogeneity.{png,pdf}               final train loss and metric vs --partition (runs that differ in it)
    <out>/scaling.{png,pdf}                     final train loss and metric vs workers n, herding_bound per epoch

    tables = aggregate_all(load_runs("results"), load_herding("results/herding"))
    plot_benchmark(tables.curves, "LR-HMDA")    # one figure
    draw_all(tables, "figures")                 # every figure

plot_worker_scaling (not in draw_all: it reads bench/scaling_cost.py's model, not runs) draws docs/scaling.md's
figure: modelled step time vs n, and the simulated herding bound vs n.

Colours, labels and axis scales come from analysis/style.py. The caller picks the backend: `python -m
analysis` uses Agg, notebooks their inline backend.
"""
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from analysis.aggregate import GROUP, LEADERBOARD_ONLY, TIME_PARTS, Tables
from analysis.paper_values import PAPER_VALUES, paper_epoch
from analysis.studies import study_figures
from analysis.style import (LINESTYLES, PART_COLORS, SORTER_COLORS, curve_styles, metric_label as _label,
                            WORKER_LINESTYLES, scale_value_axis, sorter_styles)

SECONDS_LABEL = "training seconds (cumulative; evaluation excluded)"  # what cum_seconds sums: epoch_seconds


def _curve_labels(groups):
    """{GROUP tuple: label}: the sorter name, plus the run setting that sets it apart from the
    benchmark's other runs (load_runs' `setting` column, e.g. "zero hidden state") when there is one."""
    labels = {}
    for g in groups:
        setting = dict(zip(GROUP, g))["setting"]
        labels[g] = f"{g[1]} ({setting})" if setting else g[1]
    return labels


def plot_benchmark(curves, benchmark, x="epoch", band="std"):
    """One panel per metric (train_loss + the headline metrics), one curve per sorter (x setting),
    mean over seeds with a shaded band, each curve its own colour and legend entry (style.curve_styles).
    curves: aggregate.benchmark_curves (Tables.curves), made with this `band`. x: "epoch" or "seconds"
    (mean cumulative wall clock). Against epochs, the paper's values are drawn as stars beside the curves
    whose runs have the paper's settings (its `paper` column), only for their sorters. Each panel's y axis
    follows style.scale_value_axis."""
    if x not in ("epoch", "seconds"):
        raise ValueError(f"x must be 'epoch' or 'seconds', got {x!r}")
    agg = curves[curves["benchmark"] == benchmark] if len(curves) else curves
    if agg.empty:
        return None
    metrics = list(agg.sort_values("panel")["metric"].unique())
    paper = {tuple(g) for g in agg.loc[agg["paper"].astype(bool), GROUP].itertuples(index=False)}
    # a sorter's curve with the paper's settings first: it keeps the sorter's own colour, as its star does
    groups = sorted({tuple(g) for g in agg[GROUP].itertuples(index=False)},
                    key=lambda g: (g[1], g not in paper, g))
    # + room for the legend beside the panels
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.8 * len(metrics) + 2.6, 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        _curve_panel(ax, agg[agg["metric"] == metric], groups, paper, benchmark, x)
    handles = {}  # every curve and star of every panel (a panel may lack some), once each
    for ax in axes[0]:
        handles.update(zip(*reversed(ax.get_legend_handles_labels())))
    # outside the panels: inside, it hid curves and the notes of paper values off the scale
    axes[0][-1].legend(handles.values(), handles.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    band_text = "mean ± 1 std" if band == "std" else "mean, min–max"
    title = f"{benchmark} vs {'epoch' if x == 'epoch' else 'training time'} ({band_text} over seeds)"
    if x == "epoch" and benchmark in PAPER_VALUES and not paper:
        title += "\nno run has the paper's settings: its values are not drawn"
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _curve_panel(ax, agg, groups, paper, benchmark, x):
    """One metric's panel of plot_benchmark: a curve and band per group (GROUP tuple) with rows in `agg`,
    the paper's stars beside the groups in `paper`, the value axis scaled to what is drawn."""
    styles = curve_styles((g[1], g) for g in groups)
    labels = _curve_labels(groups)
    metric = agg["metric"].iloc[0]
    means, lows, highs, star_colors = [], [], [], {}
    for g in groups:
        rows = agg[(agg[GROUP] == list(g)).all(axis=1)].sort_values("epoch")
        if rows.empty:
            continue
        xs, style = rows[x].to_numpy(float), styles[(g[1], g)]
        # markers: a one-epoch run is a single point, which a line alone does not draw
        ax.plot(xs, rows["mean"], marker="o", markersize=3, **style, label=f"{labels[g]} ({_seeds_text(rows)})")
        ax.fill_between(xs, rows["lo"].to_numpy(float), rows["hi"].to_numpy(float), color=style["color"],
                        alpha=0.2, lw=0)
        means += rows["mean"].to_list()
        lows += rows["lo"].to_list()
        highs += rows["hi"].to_list()
        if g in paper:
            star_colors.setdefault(g[1], style["color"])
    stars = _paper_values(benchmark, metric, star_colors) if x == "epoch" else []
    near, far = _split_stars(stars, lows + means, highs + means)
    for star in near:
        _draw_star(ax, star)
    scale_value_axis([ax], means + [star["value"] for star in near])
    if far:
        _draw_far_stars(ax, far)
    ax.set_xlabel("epoch" if x == "epoch" else SECONDS_LABEL)
    ax.set_ylabel(_label(metric, benchmark))
    ax.grid(alpha=0.3)


def _seeds_text(rows) -> str:
    """How many seeds a curve's mean is over: "3 seeds", or, for runs that stopped at different epochs,
    "2 seeds to epoch 7, 1 after" (the mean jumps where a seed ends, which the label then explains)."""
    epochs, counts = rows["epoch"].astype(int).to_list(), rows["count"].astype(int).to_list()
    most = max(counts)
    plural = "s" * (most > 1)
    if min(counts) == most:
        return f"{most} seed{plural}"
    if counts != sorted(counts, reverse=True):
        return f"{min(counts)}-{most} seeds per epoch"
    last = max(e for e, c in zip(epochs, counts) if c == most)
    after = {c for e, c in zip(epochs, counts) if e > last}
    return f"{most} seed{plural} to epoch {last}, {after.pop() if len(after) == 1 else 'fewer'} after"


def _paper_values(benchmark, metric, colors) -> list:
    """[{"sorter", "epoch", "value", "color"}]: the paper's value of `metric` for each sorter in
    `colors` ({sorter: colour of its curve with the paper's settings}); none for the other sorters."""
    if benchmark not in PAPER_VALUES:
        return []
    epoch, values = paper_epoch(benchmark), PAPER_VALUES[benchmark][1]  # LR-HMDA's epochs 49-50: at 49.5
    return [{"sorter": sorter, "epoch": epoch, "value": value, "color": colors[sorter]}
            for sorter, value in values.get(metric, {}).items() if sorter in colors]


def _split_stars(stars, lows, highs):
    """(stars drawn among the curves, stars marked at the panel's edge): a paper value that would more
    than double the y range the runs' curves and bands need goes to the edge, so that a paper value
    measured on other data does not flatten the runs' differences into one line."""
    finite = [v for v in lows + highs if v == v]
    if not finite:
        return stars, []
    lo, hi = min(finite), max(finite)
    span = hi - lo
    near = [s for s in stars if lo - span <= s["value"] <= hi + span]
    return near, [s for s in stars if s not in near]


def _draw_star(ax, star, **kwargs):
    ax.plot([star["epoch"]], [star["value"]], ls="none", marker="*", markersize=11, color=star["color"],
            markeredgecolor="black", markeredgewidth=0.6,
            label=f"paper {star['sorter']} (epoch {star['epoch']:g})", **kwargs)


def _draw_far_stars(ax, stars):
    """Stars off the curves' range: each keeps its Line2D at the paper's value (outside the view, in the
    legend) and gets a note at the panel's top or bottom edge: an arrow pointing its way and the value."""
    ax.autoscale_view()
    bottom, top = ax.get_ylim()
    for star in stars:
        _draw_star(ax, star, scaley=False)
    ax.set_ylim(bottom, top)  # the curves' range, fixed: the stars above must not stretch it
    above = [s for s in stars if s["value"] > top]
    below = [s for s in stars if s["value"] < bottom]
    for side, group in ((1, above), (-1, below)):
        for k, star in enumerate(group):
            y = 0.97 - 0.08 * k if side > 0 else 0.03 + 0.08 * k
            ax.annotate(f"{'↑' if side > 0 else '↓'} paper {star['sorter']}: {star['value']:g}",
                        xy=(star["epoch"], y), xycoords=ax.get_xaxis_transform(), ha="right",
                        va="top" if side > 0 else "bottom", fontsize=7, color=star["color"],
                        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})


def plot_time_breakdown(times, benchmark):
    """Stacked bars, one per sorter (x setting): mean seconds per epoch in sorter / communication /
    compute / other (epoch minus those three). times: aggregate.time_breakdown (Tables.times)."""
    times = times[times["benchmark"] == benchmark] if len(times) else times
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
    # headroom above the tallest bar: the empty "other" layer's bottom edge is sticky and leaves none
    ax.set_ylim(0, 1.05 * max(bottom) if max(bottom) > 0 else 1)
    ax.set_ylabel("seconds per epoch (mean)")
    ax.set_title(f"{benchmark}: time per epoch")
    handles, names = ax.get_legend_handles_labels()  # top of the stack first, outside the bars
    ax.legend(handles[::-1], names[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


HERDING_TITLE = "Parallel herding bound of random unit vectors"
HERDING_REFERENCES = ("CD-GraB", "D-RR")  # drawn beside issue #60's orderers in their own herding figure


def herding_sorter(method: str) -> str:
    """The sorter a herding simulation method runs: "CD-GraB+sketch4" -> "CD-GraB", "MB-GraB+batch16" -> "MB-GraB"."""
    return method.partition("+")[0]


def plot_herding(agg, methods=None, title=HERDING_TITLE):
    """Parallel herding bound vs reorder round, one panel per worker count, one curve per method, mean
    over trials with a band; one row of panels per scale of the simulation (aggregate.herding_vectors: the
    vectors of a trial, largest first; runs of one n at two scales are never drawn in one panel); one y scale
    for all panels (style.scale_value_axis: log when the bounds span a factor of 10, as they do from the random
    start to a balancer's floor). Titles use the suite's letters (n workers, m units each; the paper swaps
    them). The trials: in the title when every curve has as many, else in a row's label when its curves have
    as many, else in the legend. agg: aggregate.aggregate_herding (Tables.herding). methods: draw only these
    (None: all)."""
    if methods is not None and not agg.empty:
        agg = agg[agg["method"].isin(list(methods))]
    if agg.empty:
        return None
    scales = sorted(agg["vectors"].unique(), reverse=True)
    counts = sorted(agg["n_workers"].unique())
    fig, axes = plt.subplots(len(scales), len(counts), figsize=(3.6 * len(counts), 3.4 * len(scales)),
                             squeeze=False, sharey=True)
    styles = sorter_styles(sorted(agg["method"].unique()))
    # trials: in the title when every curve has the same, else in a row's label when its curves have the same,
    # else in the legend (a method's most in the rows whose curves differ)
    row_trials = {vectors: set(rows["count"].astype(int)) for vectors, rows in agg.groupby("vectors")}
    every = set().union(*row_trials.values())
    mixed = agg[[len(row_trials[v]) > 1 for v in agg["vectors"]]]
    trials = mixed.groupby("method")["count"].max().astype(int).to_dict()
    label = {method: ("ALL (centralised)" if method == "ALL" else method)
             + (f" ({trials[method]} trial{'s' * (trials[method] > 1)})" if method in trials else "")
             for method in agg["method"].unique()}
    for row, vectors in zip(axes, scales):
        for ax, n in zip(row, counts):
            panel = agg[(agg["vectors"] == vectors) & (agg["n_workers"] == n)]
            if panel.empty:  # this scale has no run with n workers
                ax.set_visible(False)
                continue
            for method in sorted(panel["method"].unique()):
                rows = panel[panel["method"] == method].sort_values("round")
                color = styles[method]["color"]
                # ALL (centralised, one sequence of n*m vectors) is a reference, not a parallel bound: dashed
                ax.plot(rows["round"], rows["mean"], marker=".", color=color, ls="--" if method == "ALL" else "-",
                        label=label[method])
                ax.fill_between(rows["round"].to_numpy(float), rows["lo"].to_numpy(float),
                                rows["hi"].to_numpy(float), color=color, alpha=0.2, lw=0)
            ax.set_title(f"n={n} workers, m={int(panel['m'].iloc[0]):g} units each", fontsize=9)
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3, which="both")
        row_label = [f"{vectors:,.0f} vectors a trial"] if len(scales) > 1 else []
        if len(every) > 1 and len(row_trials[vectors]) == 1:
            count = next(iter(row_trials[vectors]))
            row_label.append(f"{count} trial{'s' * (count > 1)}")
        row[0].set_ylabel("parallel herding bound" + (f"\n({', '.join(row_label)})" if row_label else ""))
    scale_value_axis(list(axes.flat), agg["mean"].to_list())
    handles = {}  # every method of every panel (a method may be missing from some)
    for ax in axes.flat:
        handles.update(zip(*reversed(ax.get_legend_handles_labels())))
    legend_ax = [ax for ax in axes[0] if ax.get_visible()][-1]
    legend_ax.legend(handles.values(), handles.keys(), fontsize=8, loc="upper left",
                     bbox_to_anchor=(1.02, 1))  # outside: the curves fill the panels
    if len(every) == 1:
        count = next(iter(every))
        title = f"{title} ({count} trial{'s' * (count > 1)})"
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_herding_figures(agg) -> dict:
    """{figure name: plot_herding figure or None}: "herding-bound", every method but issue #60's orderers (the
    paper's figure, with the suite's other sorters), and "herding-bound-orderers", issue #60's orderers
    (aggregate.LEADERBOARD_ONLY) beside CD-GraB and D-RR, drawn when the simulation has one of them."""
    methods = set(agg["method"]) if not agg.empty else set()
    orderers = {method for method in methods if herding_sorter(method) in LEADERBOARD_ONLY}
    return {"herding-bound": plot_herding(agg, methods - orderers),
            "herding-bound-orderers": plot_herding(agg, orderers | set(HERDING_REFERENCES) & methods,
                                                   f"{HERDING_TITLE}: issue #60's orderers") if orderers else None}


def _final_points(ax, points):
    """One panel of final values (aggregate.final_points' rows of one group and metric): mean ± std over
    seeds at each level's position, one line per sorter, sorters a little apart so the error bars do not
    overlap."""
    sorters = sorted(points["sorter"].unique())
    styles = sorter_styles(sorters)
    for i, sorter in enumerate(sorters):
        stats = points[points["sorter"] == sorter].sort_values("position")
        xs = [position + 0.06 * (i - (len(sorters) - 1) / 2) for position in stats["position"]]
        seeds = int(stats["count"].max())
        ax.errorbar(xs, stats["mean"], yerr=stats["std"].fillna(0), marker="o", capsize=3,
                    color=styles[sorter]["color"], label=f"{sorter} ({seeds} seed{'s' * (seeds > 1)})")
    scale_value_axis([ax], points["min"].to_list() + points["max"].to_list())  # the runs' values span these
    ax.set_ylabel(f"final {_label(points['metric'].iloc[0], points['benchmark'].iloc[0])}")
    ax.grid(alpha=0.3)


def _point_groups(points) -> list:
    """[(benchmark, study, rows)] of a final_points table, in its order; rows: the group's points."""
    return [(benchmark, study, rows) for (benchmark, study), rows in points.groupby(["benchmark", "study"], sort=True)]


def _levels(rows) -> list:
    """The x axis of a group's panels: its levels in their positions."""
    return list(rows.drop_duplicates("position").sort_values("position")["level"])


def _group_title(ax, benchmark, study, rows):
    ax.set_title(f"{benchmark}{f' ({study})' if study else ''}, epoch {int(rows['last_epoch'].iloc[0])}", fontsize=9)
    ax.legend(fontsize=8)


def plot_heterogeneity(points):
    """One row per benchmark and study whose runs differ in --partition: final train loss and final
    headline metric (mean ± std over seeds) against the partition, from least to most label skew.
    points: aggregate.final_points(df, "partition") (Tables.heterogeneity)."""
    groups = _point_groups(points)
    if not groups:
        return None
    fig, axes = plt.subplots(len(groups), 2, figsize=(10, 3.6 * len(groups)), squeeze=False)
    for row, (benchmark, study, rows) in zip(axes, groups):
        order = _levels(rows)
        for ax, (_, panel) in zip(row, rows.groupby("panel", sort=True)):
            _final_points(ax, panel)
            ax.set_xticks(range(len(order)), order)
            ax.set_xlabel("--partition (label skew across workers grows to the right)")
        _group_title(row[0], benchmark, study, rows)
    fig.suptitle("Heterogeneous workers: final values vs partition (mean ± 1 std over seeds)")
    fig.tight_layout()
    return fig


def plot_scaling(points, herding):
    """One row per benchmark and study whose runs differ in the worker count n: final train loss and
    final headline metric vs n, and, where logged, herding_bound per epoch (colour: sorter, line style: n;
    y scale: style.scale_value_axis). points: aggregate.final_points(df, "node_cnt") (Tables.scaling);
    herding: aggregate.herding_per_epoch (Tables.scaling_herding)."""
    groups = _point_groups(points)
    if not groups:
        return None
    fig, axes = plt.subplots(len(groups), 3, figsize=(15, 3.6 * len(groups)), squeeze=False)
    for row, (benchmark, study, rows) in zip(axes, groups):
        order = _levels(rows)
        batches = rows.drop_duplicates("level").set_index("level")["B"]
        for ax, (_, panel) in zip(row, rows.groupby("panel", sort=True)):
            _final_points(ax, panel)
            ax.set_xticks(range(len(order)), [f"n={n}\nB={batches[n]}" for n in order])
            ax.set_xlabel("workers n (global batch B)")
        _group_title(row[0], benchmark, study, rows)
        bounds = herding[(herding["benchmark"] == benchmark) & (herding["study"] == study)] if len(herding) else herding
        _herding_per_epoch(row[2], bounds, order)
    fig.suptitle("Worker scaling, same batch per worker: final values vs n (mean ± 1 std over seeds)")
    fig.tight_layout()
    return fig


def _herding_per_epoch(ax, bounds, order):
    """The scaling figure's third panel: herding_per_epoch's rows of one group, a line per sorter and n."""
    if bounds.empty:
        ax.text(0.5, 0.5, "no herding_bound column\n(run with --log-herding)", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        return
    colors = sorter_styles(sorted(bounds["sorter"].unique()))
    for sorter in sorted(bounds["sorter"].unique()):
        for j, n in enumerate(order):
            line = bounds[(bounds["sorter"] == sorter) & (bounds["node_cnt"] == n)].sort_values("epoch")
            if len(line):
                ax.plot(line["epoch"], line["mean"], ls=WORKER_LINESTYLES[j % len(WORKER_LINESTYLES)], marker=".",
                        color=colors[sorter]["color"], label=f"{sorter}, n={n}")
    scale_value_axis([ax], bounds["mean"].to_list())
    ax.set_xlabel("epoch")
    ax.set_ylabel("herding bound (mean over seeds)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)


SKETCH_MARKERS = "x^v+"


def sketch_dims(herding: dict) -> set:
    """The D of every "<sorter>+sketch<D>" method in the herding frames, as strings."""
    return {method.split("+sketch")[1] for hdf in herding.values() for method in hdf["method"].unique()
            if "+sketch" in method}


def plot_worker_scaling(cost: dict, herding: dict):
    """Two panels against the worker count n (log axes): left, the modelled step time of exact (solid) and
    sketched (dashed) CD-GraB as a multiple of D-RR's, one marker per benchmark (cost: bench/scaling_cost.py's
    JSON); right, the last round's parallel herding bound of CD-GraB and D-RR (mean over trials, band: min-max;
    herding: {setting label: load_herding frame of scripts/herding_simulation.py's CSVs}, one line style per
    setting). Colours: style.SORTER_COLORS."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    sketched = curve_styles([("CD-GraB", "exact"), ("CD-GraB", "sketched")])[("CD-GraB", "sketched")]["color"]
    markers = dict(zip(cost["benchmarks"], "osD^v"))
    for benchmark, entry in cost["benchmarks"].items():
        ns = [row["n"] for row in entry["rows"]]
        for method, color, ls in (("CD-GraB", SORTER_COLORS["CD-GraB"], "-"), ("sketched", sketched, "--")):
            if method == "sketched" and entry["sketch_is_identity"]:
                continue  # D >= d: the sketch is the identity, i.e. exact CD-GraB
            ratio = [row[method]["step_seconds"] / row["D-RR"]["step_seconds"] for row in entry["rows"]]
            setting = "exact" if method == "CD-GraB" else f"D={entry['sketch_dim']}"
            left.plot(ns, ratio, color=color, ls=ls, marker=markers[benchmark], ms=4, label=f"{benchmark}, {setting}")
    left.axhline(cost["slowdown"], color="black", lw=0.8, ls=":")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("workers n")
    left.set_ylabel("modelled step time / D-RR's")
    left.set_title(f"ring model, {cost['bandwidth_bytes_per_second'] * 8 / 1e9:g} Gb/s, bandwidth only", fontsize=9)
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize=6, ncol=2)
    last_round, trials = 0, 0
    for (setting, hdf), ls in zip(herding.items(), LINESTYLES):
        last_round = int(hdf["round"].max())
        final = hdf[hdf["round"] == last_round]
        stats = final.groupby(["method", "n_workers"])["bound"].agg(["mean", "min", "max", "count"]).reset_index()
        trials = max(trials, int(stats["count"].max()))
        for method in sorted(stats["method"].unique()):
            rows = stats[stats["method"] == method].sort_values("n_workers")
            # "<sorter>+sketch<D>" (herding_simulation.py --sketch-dim): the sketched colour, a marker per D
            color, marker = SORTER_COLORS.get(method, "black"), "."
            if "+sketch" in method:
                color, marker = sketched, SKETCH_MARKERS[sorted(sketch_dims(herding)).index(method.split("+sketch")[1])]
            right.plot(rows["n_workers"], rows["mean"], marker=marker, color=color, ls=ls, label=f"{method}, {setting}")
            right.fill_between(rows["n_workers"].to_numpy(float), rows["min"].to_numpy(float),
                               rows["max"].to_numpy(float), color=color, alpha=0.15, lw=0)
    right.set_xscale("log", base=2)
    right.set_yscale("log")  # the two methods' bounds differ by two orders of magnitude
    right.set_xlabel("workers n")
    right.set_ylabel(f"herding bound after round {last_round}")
    right.set_title(f"simulation, d 16, mean of {trials} trials (band: min-max)", fontsize=9)
    right.grid(alpha=0.3, which="both")
    right.legend(fontsize=7)
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


def draw_all(tables: Tables, out_dir) -> list:
    """Save every figure the tables (aggregate.aggregate_all) allow into out_dir (closing each); return the
    written paths."""
    figs = {}
    for benchmark in sorted(tables.curves["benchmark"].unique()) if len(tables.curves) else []:
        figs[f"{benchmark}-vs-epoch"] = plot_benchmark(tables.curves, benchmark, "epoch", tables.band)
        figs[f"{benchmark}-vs-seconds"] = plot_benchmark(tables.curves, benchmark, "seconds", tables.band)
        figs[f"{benchmark}-time-breakdown"] = plot_time_breakdown(tables.times, benchmark)
    figs.update(plot_herding_figures(tables.herding))
    figs["heterogeneity"] = plot_heterogeneity(tables.heterogeneity)
    figs["scaling"] = plot_scaling(tables.scaling, tables.scaling_herding)
    figs.update(study_figures(tables))
    written = []
    for name, fig in figs.items():
        if fig is not None:
            written += save_figure(fig, out_dir, name)
            plt.close(fig)
    return written
