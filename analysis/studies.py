"""Tables and figures of the studies whose sweeps write into <results>/<study>/<benchmark>/<run>:

    communication   scripts/sweep-communication.sh: synchronisation rule x reducer x sorter (issue #9)
    sketching       --sketch-dim: CD-GraB balancing CountSketches of the gradients (issue #20), or the
                    structured map (--sketch-min-numel: TensorSketch blocks for the layer weights, issue
                    #31); its training curves are drawn against the benchmark's own exact CD-GraB and D-RR runs
    reorderers      other coordinated reorderers (KH-SGD, SBW: issue #21), drawn against the
                    benchmark's CD-GraB and D-RR runs of the same settings

`study_figures(df)` returns {file stem: Figure} for every study present in a load_runs frame.
"""
import json
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.lines import Line2D

from analysis.aggregate import headline_metrics, std_over_seeds
from analysis.load import result_settings, run_args
from analysis.style import curve_styles, metric_label, scale_value_axis

STUDIES_WITH_FIGURES = ("communication", "sketching", "reorderers")  # study_figures draws these
COMMUNICATION_ARGS = ["sync", "H", "alpha", "H_base", "reducer", "density", "lr_schedule"]
STRATEGY_MARKERS = {"every-step": "o", "constant": "s", "qsr": "^", "linear": "v", "post-local": "D"}
REDUCER_FILL = {"dense": "full", "topk": "left", "exdyna": "none"}


def communication_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (benchmark, sorter, sync, reducer) of the communication study: the last epoch's
    train loss and headline metric (mean and population std over seeds, as the paper's notebooks), the bytes and averaging steps of the whole run
    (summed over epochs, mean over seeds), mean_H = the run's steps per averaging, the achieved density
    (mean over epochs), and the median seconds per epoch (over every epoch of every seed: robust to an epoch
    slowed by other work on a shared machine) with its ratio to every-step + dense of the same sorter."""
    runs = df[df["study"] == "communication"] if len(df) else df
    if not len(runs):
        return pd.DataFrame()
    runs = runs.merge(run_args(runs, COMMUNICATION_ARGS), on="run_dir", suffixes=("", "_arg"))
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
    order = {name: i for i, name in enumerate(STRATEGY_MARKERS)}
    return table.sort_values(["benchmark", "sorter", "sync", "reducer"], key=lambda c: c.map(order) if c.name == "sync"
                             else c).reset_index(drop=True)


def plot_communication(df: pd.DataFrame, benchmark: str):
    """Final train loss and headline metric against the gigabytes communicated over the run (log x):
    colour = sorter, marker = synchronisation rule, hollow = ExDyna. None without such runs."""
    table = communication_table(df)
    if not len(table) or benchmark not in set(table["benchmark"]):
        return None
    table = table[table["benchmark"] == benchmark]
    metric = table["metric"].iloc[0]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    # colour: sorter; a sorter's settings (sync x reducer) have their own marker and fill instead
    colors = {sorter: style["color"] for (sorter, _), style in
              curve_styles((sorter, None) for sorter in sorted(table["sorter"].unique())).items()}
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


SKETCH_ARGS = ["sketch_dim", "max_train_examples", "node_cnt", "B", "lr"]


def _comparable_settings(run_dir: str) -> str:
    """A run's result-changing args (engine/flags.py) without those a sketching baseline may differ in:
    the sorter, the seed, the sketch (its D and which weights are TensorSketch blocks) and the herding log
    (which does not change the run)."""
    settings = result_settings(json.loads((Path(run_dir) / "config.json").read_text()))
    return json.dumps({key: value for key, value in settings.items()
                       if key not in ("sorter", "seed", "sketch_dim", "sketch_min_numel", "log_herding")},
                      sort_keys=True, default=str)


def study_with_baselines(df: pd.DataFrame, study: str) -> pd.DataFrame:
    """The runs of `study` and, as their baselines, the exact CD-GraB and D-RR runs elsewhere (the
    benchmark's own runs, other studies) whose settings equal a group of the study's runs in everything
    but the sorter, seed and sketch (workers, batch, learning rate and schedule, data, synchronisation,
    ...), cut at that group's last epoch. df: a load_runs frame with the `sketch_dim` column of run_args."""
    df = df.assign(comparable=df["run_dir"].map({run: _comparable_settings(run) for run in df["run_dir"].unique()}))
    runs = df[df["study"] == study]
    groups = runs.groupby("comparable")["epoch"].max().rename("last_epoch").reset_index()
    baselines = df[(df["study"] != study) & df["sorter"].isin(["CD-GraB", "D-RR"]) & (df["sketch_dim"] == 0)]
    baselines = baselines.merge(groups, on="comparable")
    baselines = baselines[baselines["epoch"] <= baselines["last_epoch"]].drop(columns="last_epoch")
    return pd.concat([runs, baselines], ignore_index=True).drop(columns="comparable")


def sketch_blocks(run_dir: str) -> list:
    """The TensorSketch blocks [offset, rows, cols] of a run's map, as its config.json records them
    (`sorter.sketch.blocks`; [] for a plain CountSketch, exact CD-GraB, D-RR, or a run from before
    --sketch-min-numel)."""
    config = json.loads((Path(run_dir) / "config.json").read_text())
    return list((config.get("sorter") or {}).get("sketch", {}).get("blocks") or [])


STRUCTURED = ", structured"  # the variant suffix of a map with TensorSketch blocks


def sketching_runs(df: pd.DataFrame, benchmark: str) -> pd.DataFrame:
    """The sketching study's runs of `benchmark` with their baselines (study_with_baselines). One row per
    (run, epoch), with `variant` ("D-RR", "CD-GraB exact", "CD-GraB, D = 64" for a plain CountSketch,
    "CD-GraB, D = 64, structured" for a map with TensorSketch blocks), `structured` (the map has blocks),
    `full_data` (no --max-train-examples) and `examples` (--max-train-examples, 0 for the full data).
    Empty without sketching runs."""
    if not len(df):
        return df
    df = df[df["benchmark"] == benchmark]
    if not (df["study"] == "sketching").any():
        return df.iloc[:0]
    df = df.merge(run_args(df, ["sketch_dim", "max_train_examples"]), on="run_dir")
    df["examples"] = df["max_train_examples"].fillna(0)
    runs = study_with_baselines(df, "sketching")
    runs["full_data"] = runs["examples"] == 0
    runs["structured"] = runs["run_dir"].map({run: bool(sketch_blocks(run)) for run in runs["run_dir"].unique()})
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


def reorderer_runs(df: pd.DataFrame, benchmark: str) -> pd.DataFrame:
    """The reorderers study's runs of `benchmark` with their CD-GraB and D-RR baselines
    (study_with_baselines): one row per (run, epoch). Empty without such runs."""
    if not len(df):
        return df
    df = df[df["benchmark"] == benchmark]
    if not (df["study"] == "reorderers").any():
        return df.iloc[:0]
    return study_with_baselines(df.merge(run_args(df, ["sketch_dim"]), on="run_dir"), "reorderers")


REORDERER_ORDER = ("CD-GraB", "KH-SGD", "SBW", "D-RR")


def reorderer_order(sorter: str) -> int:
    """CD-GraB, KH-SGD, SBW, D-RR, then any other sorter."""
    return REORDERER_ORDER.index(sorter) if sorter in REORDERER_ORDER else len(REORDERER_ORDER)


def plot_reorderers(df: pd.DataFrame, benchmark: str):
    """Train loss and the benchmark's headline metric per epoch (mean over seeds, std band) of every
    sorter of the reorderers study and its baselines; one row of panels per number of workers. None
    without reorderer runs."""
    runs = reorderer_runs(df, benchmark)
    if not len(runs):
        return None
    metrics = ["train_loss", *headline_metrics(runs, benchmark)[:1]]
    worker_counts = sorted(runs["node_cnt"].unique())
    fig, axes = plt.subplots(len(worker_counts), len(metrics), figsize=(6 * len(metrics), 3.8 * len(worker_counts)),
                             squeeze=False)
    styles = curve_styles((sorter, None) for sorter in sorted(runs["sorter"].unique(), key=reorderer_order))
    for row, n in zip(axes, worker_counts):
        group = runs[runs["node_cnt"] == n]
        sorters = sorted(group["sorter"].unique(), key=reorderer_order)
        for ax, metric in zip(row, metrics):
            means = []
            for sorter in sorters:
                rows = group[group["sorter"] == sorter]
                curve = rows.groupby("epoch")[metric].agg(["mean", std_over_seeds]).rename(columns={"std_over_seeds": "std"})
                colour = styles[(sorter, None)]["color"]
                means += curve["mean"].to_list()
                ax.plot(curve.index, curve["mean"], color=colour, linewidth=1.4,
                        label=f"{sorter} ({rows['run_dir'].nunique()} seeds)")
                ax.fill_between(curve.index, curve["mean"] - curve["std"].fillna(0),
                                curve["mean"] + curve["std"].fillna(0), color=colour, alpha=0.12, linewidth=0)
            scale_value_axis([ax], means)
            title = f"{metric_label(metric, benchmark)}, {n} worker{'s' if n > 1 else ''}"
            if metric == "train_loss":  # the late epochs are where the sorters differ
                late = group[group["epoch"] >= group["epoch"].max() * 0.3].groupby(["sorter", "epoch"])[metric].mean()
                spread = late.max() - late.min()
                ax.set_ylim(late.min() - 0.1 * spread, late.max() + 0.1 * spread)
                # the first epochs leave the panel: say so, or the cut curves read as a drawing fault
                first = int(late.index.get_level_values("epoch").min())
                title += f" (y range: epochs {first}-{int(group['epoch'].max())})"
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("epoch")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    B, lr = int(runs["B"].iloc[0]), runs["lr"].iloc[0]
    fig.suptitle(f"{benchmark}: KH-SGD and SBW, coordinated, against CD-GraB and D-RR\n(B {B}, lr {lr:g}; "
                 f"band: std over seeds)", fontsize=11)
    fig.tight_layout()
    return fig


def variant_order(variant: str) -> tuple:
    """CD-GraB exact, then the sketches by decreasing D (the CountSketch before the structured map of the
    same D), then D-RR."""
    if variant == "CD-GraB exact":
        return (0, 0, 0)
    if variant.startswith("CD-GraB, D = "):
        structured = variant.endswith(STRUCTURED)
        return (1, -int(variant.removesuffix(STRUCTURED).rsplit(" ", 1)[1]), int(structured))
    return (2, 0, 0)


SKETCH_SHADES = ["tab:orange", "tab:purple", "tab:green", "tab:brown", "tab:olive"]


def sketch_style(variant: str, colours: dict) -> dict:
    """A variant's line style in the sketching figure: exact CD-GraB red, D-RR blue, a colour per D
    (`colours`, filled in here in order of first use), the CountSketch solid with round markers, the
    structured map (TensorSketch blocks) of the same D in the same colour, dashed, with square markers."""
    base = variant.removesuffix(STRUCTURED)
    if base not in colours:
        used = set(colours.values())
        colours[base] = next((c for c in SKETCH_SHADES if c not in used), "tab:gray")
    structured = variant.endswith(STRUCTURED)
    return {"color": colours[base], "linestyle": "--" if structured else "-", "marker": "s" if structured else "o"}


def plot_sketching(df: pd.DataFrame, benchmark: str):
    """The panels that have runs, of: the herding bound of the real gradients per epoch under each
    variant's orders (the runs with --log-herding); the train loss per epoch of those runs; the train loss
    per epoch on the full data; each mean over seeds with a std band, sketched (CountSketch solid, the
    structured map dashed with square markers) against exact CD-GraB and D-RR; and the herding bound of
    each sketched variant and of D-RR as a multiple of exact CD-GraB's of the same seed (herding_ratios),
    seed by seed. None without sketching runs."""
    runs = sketching_runs(df, benchmark)
    if not len(runs):
        return None
    herding = runs[runs["herding_bound"].notna()] if "herding_bound" in runs else runs.iloc[:0]
    full = runs[runs["full_data"]]
    panels = [(frame, column) for frame, column in ((herding, "herding_bound"), (herding, "train_loss"),
                                                    (full, "train_loss")) if len(frame)]
    ratios = herding_ratios(runs)
    ratios = ratios[ratios["variant"] != "CD-GraB exact"].dropna(subset=["mean_ratio"])
    count = len(panels) + bool(len(ratios))
    shape = (2, 2) if count == 4 else (1, count)
    fig, axes = plt.subplots(*shape, figsize=(6.5 * shape[1], 4.2 * shape[0]), squeeze=False)
    axes = axes.ravel()
    colours = {"CD-GraB exact": "tab:red", "D-RR": "tab:blue"}
    for variant in sorted(runs["variant"].unique(), key=variant_order):
        sketch_style(variant, colours)  # colours in D order, whichever panel draws a variant first
    for ax, (frame, column) in zip(axes, panels):
        means = []
        for variant in sorted(frame["variant"].unique(), key=variant_order):
            rows = frame[frame["variant"] == variant]
            curve = rows.groupby("epoch")[column].agg(["mean", std_over_seeds, "count"]) \
                .rename(columns={"std_over_seeds": "std"})
            means += curve["mean"].to_list()
            style = sketch_style(variant, colours)
            ax.plot(curve.index, curve["mean"], markersize=3.5, **style,
                    label=f"{variant} ({rows['run_dir'].nunique()} seeds)")
            ax.fill_between(curve.index, curve["mean"] - curve["std"].fillna(0), curve["mean"] + curve["std"].fillna(0),
                            color=style["color"], alpha=0.08 if variant.endswith(STRUCTURED) else 0.12, linewidth=0)
        examples = frame["max_train_examples"].dropna()
        data = f"first {int(examples.iloc[0]):,} training examples" if len(examples) else "the full training set"
        what = "herding bound of the real gradients" if column == "herding_bound" else "train loss"
        ax.set_title(f"{what} ({data}, {int(frame['epoch'].max())} epochs)", fontsize=10)
        ax.set_xlabel("epoch")
        ax.set_ylabel("herding bound" if column == "herding_bound" else "train loss")
        scale_value_axis([ax], means)
        # epoch 1's herding bound (the random first order) is several times the rest's, and the first epochs'
        # losses dwarf the differences between the variants at the end: the y range is that of the later epochs
        first = 2 if column == "herding_bound" else max(2, int(frame["epoch"].max() * 0.3))
        if frame["epoch"].max() > first:
            later = frame[frame["epoch"] >= first].groupby(["variant", "epoch"])[column]
            low, high = (later.mean() - later.std().fillna(0)).min(), (later.mean() + later.std().fillna(0)).max()
            ax.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))
            ax.set_title(ax.get_title() + f"\n(y range: epochs {first} on; the earlier ones above it)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if len(ratios):
        plot_herding_ratios(axes[len(panels)], ratios, colours)
    for ax in axes[count:]:
        ax.set_visible(False)
    n, B = int(runs["node_cnt"].iloc[0]), int(runs["B"].iloc[0])
    fig.suptitle(f"{benchmark}: CD-GraB on D-dimensional gradient sketches (structured: TensorSketch blocks for the "
                 f"layer weights)\n({n} workers, B {B}; band: std over seeds)", fontsize=11)
    fig.tight_layout()
    return fig


def plot_herding_ratios(ax, ratios: pd.DataFrame, colours: dict) -> None:
    """herding_ratios' per-seed ratios to exact CD-GraB (filled: mean over epochs 2 on; hollow: last
    epoch), one column per D (CountSketch circles on the left, the structured map's squares on the right)
    and one for D-RR, with the lines 1 (exact) and 1.25 (issue #31's goal). Each variant's points are one
    Line2D per statistic, labelled "<variant>: mean of epochs 2+" / "<variant>: last epoch"; the legend
    explains the markers instead of listing them."""
    bases = sorted({v.removesuffix(STRUCTURED) for v in ratios["variant"]},
                   key=lambda v: (v == "D-RR", -variant_order(v)[1]))  # increasing D, then D-RR
    for variant in sorted(ratios["variant"].unique(), key=variant_order):
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


def study_figures(df: pd.DataFrame) -> dict:
    """{file stem: Figure} of every study with runs in df."""
    figs = {}
    if len(df) and (df["study"] == "communication").any():
        for benchmark in sorted(df.loc[df["study"] == "communication", "benchmark"].unique()):
            figs[f"communication-{benchmark}"] = plot_communication(df, benchmark)
    if len(df) and (df["study"] == "sketching").any():
        for benchmark in sorted(df.loc[df["study"] == "sketching", "benchmark"].unique()):
            figs[f"sketching-{benchmark}"] = plot_sketching(df, benchmark)
    if len(df) and (df["study"] == "reorderers").any():
        for benchmark in sorted(df.loc[df["study"] == "reorderers", "benchmark"].unique()):
            figs[f"reorderers-{benchmark}"] = plot_reorderers(df, benchmark)
    return {name: fig for name, fig in figs.items() if fig is not None}
