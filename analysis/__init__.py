"""Logs to figures in one pass: load the runs (analysis/load.py), aggregate everything the figures and tables
need (analysis/aggregate.py), draw each figure from its table (analysis/plots.py, analysis/studies.py; colours
and axes: analysis/style.py).

    from analysis import aggregate_all, load_configs, load_herding, load_runs, plots
    df = load_runs("results")                     # one row per (run, epoch)
    tables = aggregate_all(df, load_herding("results/herding"), load_configs(df))
    plots.draw_all(tables, "figures")             # every figure; tables.final: the final-metric table
    plots.plot_benchmark(tables.curves, "LR-HMDA")  # one figure

    agg = aggregate(df, ["train_loss"])           # mean/std/min/max/count over seeds per epoch

Command line: python -m analysis [RESULTS_DIR] --out figures/   (see --help; without RESULTS_DIR: results/ if
it holds runs, else the shipped reproduction/)
"""
from analysis import plots
from analysis.aggregate import (BENCHMARKS, EXPECTED_SORTERS, HEADLINE, Tables, aggregate, aggregate_all,
                                aggregate_herding, final_table, headline_metrics, missing_sorters, time_breakdown)
from analysis.load import Problem, default_results_dir, load_configs, load_herding, load_runs

__all__ = ["BENCHMARKS", "EXPECTED_SORTERS", "HEADLINE", "Problem", "Tables", "aggregate", "aggregate_all",
           "aggregate_herding", "default_results_dir", "final_table", "format_table", "headline_metrics",
           "load_configs", "load_herding", "load_runs", "missing_sorters", "plots", "time_breakdown"]


def format_table(table) -> str:
    """final_table as text: one line per benchmark x sorter (x setting), 'mean ± std' and the seed count;
    the setting column only when some benchmark has runs that differ in their settings."""
    if table.empty:
        return "(no finished runs)"
    shown = table.assign(
        lr=table["lr"].map("{:g}".format),
        final=[f"{m:.4g} ± {s:.2g}" if s == s else f"{m:.4g}" for m, s in zip(table["mean"], table["std"])])
    setting = ["setting"] if (table["setting"] != "").any() else []
    return shown[["benchmark", "sorter", "node_cnt", "B", "lr", *setting, "metric", "epoch", "final",
                  "seeds"]].to_string(index=False)
