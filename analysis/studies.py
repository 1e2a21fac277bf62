"""Tables and figures of the studies whose sweeps write into <results>/<study>/<benchmark>/<run>:

    communication   scripts/sweep-communication.sh: synchronisation rule x reducer x sorter (issue #9)

`study_figures(df)` returns {file stem: Figure} for every study present in a load_runs frame.
"""
import matplotlib.pyplot as plt
import pandas as pd

from analysis.aggregate import headline_metrics
from analysis.load import run_args

COMMUNICATION_ARGS = ["sync", "H", "alpha", "H_base", "reducer", "density", "lr_schedule"]
STRATEGY_MARKERS = {"every-step": "o", "constant": "s", "qsr": "^", "linear": "v", "post-local": "D"}
REDUCER_FILL = {"dense": "full", "topk": "left", "exdyna": "none"}
SORTER_COLORS = {"CD-GraB": "tab:red", "D-RR": "tab:blue", "I-B": "tab:green", "I-PB": "tab:orange"}


def communication_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (benchmark, sorter, sync, reducer) of the communication study: the last epoch's
    train loss and headline metric (mean and std over seeds), the bytes and averaging steps of the whole run
    (summed over epochs, mean over seeds), mean_H = the run's steps per averaging, the achieved density
    (mean over epochs), and the mean seconds per epoch with its ratio to every-step + dense of the same sorter."""
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
                     "train_loss": last["train_loss"].mean(), "train_loss_std": last["train_loss"].std(),
                     "metric": metric, "final": last[metric].mean(), "final_std": last[metric].std(),
                     "gigabytes": totals["comm_bytes"].mean() / 1e9, "syncs": totals["syncs"].mean(),
                     "mean_H": (steps / totals["syncs"]).mean(), "density": group["density"].mean(),
                     "epoch_seconds": group["epoch_seconds"].mean()})
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
    for ax, column, label in zip(axes, ("train_loss", "final"), ("final train loss", f"final {metric}")):
        for row in table.itertuples():
            ax.plot(row.gigabytes, getattr(row, column), linestyle="none", marker=STRATEGY_MARKERS.get(row.sync, "x"),
                    fillstyle=REDUCER_FILL.get(row.reducer, "full"), markersize=9,
                    color=SORTER_COLORS.get(row.sorter, "tab:gray"), label=f"{row.sorter}, {row.sync}, {row.reducer}")
        ax.set_xscale("log")
        ax.set_xlabel("gigabytes communicated over the run (sum over workers)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # outside: the points fill the panel
    seeds = int(table["seeds"].min())
    fig.suptitle(f"{benchmark}: example ordering x synchronisation x sparsification "
                 f"({int(table['epochs'].max())} epochs, {seeds} seed{'s' * (seeds > 1)})")
    fig.tight_layout()
    return fig


def study_figures(df: pd.DataFrame) -> dict:
    """{file stem: Figure} of every study with runs in df."""
    figs = {}
    if len(df) and (df["study"] == "communication").any():
        for benchmark in sorted(df.loc[df["study"] == "communication", "benchmark"].unique()):
            figs[f"communication-{benchmark}"] = plot_communication(df, benchmark)
    return {name: fig for name, fig in figs.items() if fig is not None}
