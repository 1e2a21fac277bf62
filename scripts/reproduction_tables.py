"""The paper-vs-ours tables of REPRODUCTION.md, computed from run directories (never typed by hand).

    python scripts/reproduction_tables.py [RESULTS_DIR]     # default: the shipped reproduction/

Prints Markdown: per benchmark, the paper's numbers (read off its figures, issue #8) next to ours as
mean ± std over seeds (n = seed count) at the paper's epoch, the CD-GraB - D-RR gap, our training
seconds per epoch, and the herding bound after the last round; then the heterogeneity and
worker-scaling studies (issue #10): final values per partition / worker count, mean ± std over seeds, and
the communication study (issue #9), the sketching study (issue #20; with its herding bounds per seed over
exact CD-GraB's, issue #31) and the reorderers study (issue #21); last the leaderboard of every orderer
(issue #60; its orderers are left out of the paper-vs-ours tables).
Where a sorter has no run at the paper's epoch yet (partial runs), every sorter is reported at the last
epoch each of them reached, over the runs that reached it, and the row is marked partial.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from common.errors import OneLineErrorParser  # noqa: E402
from analysis import default_results_dir, load_herding, load_runs, lstm_setting  # noqa: E402
from analysis.paper_values import PAPER_HERDING, PAPER_VALUES  # noqa: E402
from analysis.aggregate import herding_vectors  # noqa: E402
from analysis.aggregate import (LEADERBOARD_BENCH, LEADERBOARD_ONLY, communication_table,  # noqa: E402
                                headline_metrics, herding_ratios, leaderboard, leaderboard_bench, leaderboard_runs,
                                partition_order, reorderer_order, reorderer_runs, sketching_runs, variant_order)
from analysis.load import REPO_ROOT, load_configs  # noqa: E402


def mean_std(values) -> str:
    """'mean ± std (n=k)' with the population std over the k values (numpy's default, which the paper's
    notebooks use for their bands: ddof 0); one value: 'mean (n=1)'."""
    values = list(values)
    if not values:
        return "-"
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    digits = 5 if abs(mean) < 10 else 2
    return f"{mean:.{digits}f} ± {std:.{digits}f} (n={len(values)})" if len(values) > 1 else f"{mean:.{digits}f} (n=1)"


def seed_list(seeds) -> str:
    """'seed 0', 'seeds 0-4', 'seeds 0, 2'."""
    seeds = sorted(int(s) for s in seeds)
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    if seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"seeds {seeds[0]}-{seeds[-1]}"
    return "seeds " + ", ".join(map(str, seeds))


def benchmark_table(df, benchmark: str, alone: dict | None = None) -> list[str]:
    """The paper-vs-ours tables of a benchmark, one per setting of its runs (e.g. with and without --clip):
    comparison_point's epochs and seeds for every column; a column whose runs there are another set of
    seeds (fewer: an ablation run for one seed) names them in its cells. Then the training seconds per
    epoch: of a GPU run only its epochs alone on the GPU (`alone`: alone_epochs), else every epoch."""
    runs = df[(df["benchmark"] == benchmark) & ~df["sorter"].isin(LEADERBOARD_ONLY)]  # those: leaderboard_markdown
    if runs.empty:
        return [f"No {benchmark} runs.", ""]
    lines = []
    for setting, group in sorted(runs.groupby("setting"), key=lambda item: item[0]):
        lines += setting_table(group, benchmark, setting, alone or {})
    return lines


def setting_table(runs, benchmark: str, setting: str, alone: dict) -> list[str]:
    epochs, metrics = PAPER_VALUES[benchmark]
    sorters = sorted(runs["sorter"].unique())
    title = f"{benchmark} ({setting})" if setting else benchmark
    lines = [f"| {title} | epoch | paper CD-GraB | paper D-RR | " + " | ".join(f"ours {s}" for s in sorters) + " |",
             "|---|---|---|---|" + "---|" * len(sorters)]
    target, seeds = comparison_point(runs, epochs, [s for s in metrics[next(iter(metrics))] if s in sorters] or sorters)
    wanted = "-".join(str(e) for e in epochs)
    where = f"{seed_list(seeds)}; " if seeds else ""
    epoch_cell = f"{wanted} ({seed_list(seeds)})" if target == list(epochs) else \
        f"{target[-1]} (partial; {where}paper: {wanted})"
    for metric, paper in metrics.items():
        if metric not in runs or runs[metric].isna().all():
            continue
        cells = []
        for sorter in sorters:
            per_seed = {seed: run[run["epoch"].isin(target)][metric].mean()
                        for (seed, _), run in runs[runs["sorter"] == sorter].groupby(["seed", "run_dir"])
                        if set(target) <= set(run["epoch"]) and (not seeds or seed in seeds)}
            cell = mean_std(per_seed.values())
            if per_seed and set(per_seed) != set(seeds):
                cell = cell[:-1] + f": {seed_list(per_seed)})"
            cells.append(cell)
        lines.append(f"| {metric} | {epoch_cell} | {paper['CD-GraB']} | {paper['D-RR']} | " + " | ".join(cells) + " |")
    return lines + [seconds_row(runs, sorters, alone), ""]


def seconds_row(runs, sorters, alone: dict) -> str:
    """Training seconds per epoch, mean over epochs: a CPU benchmark's every epoch; a GPU run's only the
    epochs it trained alone on the GPU (alone: run folder -> {epoch: device}), with their count and device."""
    on_gpu = runs["run_dir"].map(lambda run: run_device(run).startswith("cuda"))
    if not on_gpu.any():
        seconds = runs.groupby("sorter")["epoch_seconds"].mean()
        return "| training s/epoch (mean over epochs) | | | | " + " | ".join(f"{seconds[s]:.1f}" for s in sorters) + " |"
    cells = []
    for sorter in sorters:
        rows = runs[runs["sorter"] == sorter]
        picked = [(row.epoch_seconds, alone[key][int(row.epoch)]) for row in rows.itertuples()
                  if (key := str(Path(row.run_dir).resolve())) in alone and int(row.epoch) in alone[key]]
        devices = sorted({device for _, device in picked})
        cells.append(f"{sum(s for s, _ in picked) / len(picked):.1f} ({len(picked)} epoch{'s' * (len(picked) > 1)}, {', '.join(devices)})"
                     if picked else "- (no epoch alone)")
    return "| training s/epoch alone on the GPU (mean over epochs) | | | | " + " | ".join(cells) + " |"


def run_device(run_dir: str) -> str:
    try:
        return str(json.loads((Path(run_dir) / "config.json").read_text()).get("device") or "")
    except (OSError, ValueError):
        return ""


def comparison_point(runs, epochs, paired) -> tuple[list[int], list[int]]:
    """(epochs, seeds) every column of a table is read at. The seeds are those in which every sorter of
    `paired` (the paper's two, where they ran) has a run that reached the epochs: the paper's epochs when
    some seed has them all there, else (partial runs) the last epoch that some seed's runs of every paired
    sorter reached, over those seeds. No such seed at all: the last epoch every sorter reached in some run,
    over whichever runs reached it (seeds [])."""
    reached = runs.groupby(["sorter", "seed"])["epoch"].max()
    paired_reached = reached[reached.index.get_level_values("sorter").isin(paired)].unstack("sorter")
    common = paired_reached.dropna()[list(paired)].min(axis=1) if len(paired_reached.columns) == len(paired) else []
    if len(common) and common.max() >= max(epochs):
        return list(epochs), sorted(int(s) for s in common[common >= max(epochs)].index)
    if len(common):
        last = int(common.max())
        return [last], sorted(int(s) for s in common[common >= last].index)
    return [int(runs.groupby("sorter")["epoch"].max().min())], []


def alone_epochs(root: Path) -> dict:
    """Run folder (resolved) -> {epoch: device} of the epochs it trained alone on a GPU: in a call of
    scripts/gpu_session.py (root/gpu-sessions/*/session.json, oldest first) in which it was the only run
    that trained and no CUDA tests ran beside it. A later call that trained an epoch of the run again
    decides about that epoch; a call whose record of the run (its runs/ folder) is not what the run folder
    holds for those epochs (the shipped record was kept over it) decides nothing."""
    decided = {}
    for path in sorted((root / "gpu-sessions").glob("*/session.json")):
        manifest = json.loads(path.read_text())
        trained = {key: entry for key, entry in manifest.get("runs", {}).items() if entry.get("epochs_this_call")}
        if manifest.get("tiny") or not trained:
            continue
        device = manifest.get("device", "").split(",")[0] if len(trained) == 1 and "tests_exit" not in manifest else None
        for key, entry in trained.items():
            first, last = entry["epochs_done"] - entry["epochs_this_call"] + 1, entry["epochs_done"]
            record = path.parent / "runs" / key / "metrics.csv"
            if record.exists() and epoch_rows(record, first, last) != epoch_rows(root / key / "metrics.csv", first, last):
                continue
            decided.setdefault(str((root / key).resolve()), {}).update({e: device for e in range(first, last + 1)})
    return {run: {e: d for e, d in epochs.items() if d} for run, epochs in decided.items()}


def epoch_rows(path: Path, first: int, last: int) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines()[1:] if line.split(",")[0].isdigit()
                and first <= int(line.split(",")[0]) <= last]
    except OSError:
        return []


PAPER_VECTORS = 1e6  # the paper's herding simulation: 10^6 vectors a trial


def herding_table(hdf) -> list[str]:
    """The herding simulation's bound after its last round, mean ± population std over trials: one table per
    scale (analysis.aggregate.herding_vectors: the vectors of a trial, the paper's 10^6 first; runs of one n at
    two scales are never averaged together), a column per worker count n, the paper's values beside the
    paper's scale only."""
    if hdf.empty:
        return ["No herding simulation CSVs.", ""]
    last = hdf[hdf["round"] == hdf["round"].max()]
    rounds = int(last["round"].max())
    scale_of = [herding_vectors(n, m) for n, m in zip(last["n_workers"], last["m"])]
    lines = []
    for scale in sorted(set(scale_of), key=lambda v: (v != PAPER_VECTORS, -v)):
        rows = last[[v == scale for v in scale_of]]
        counts = sorted(rows["n_workers"].unique())
        paper = scale == PAPER_VECTORS
        head = f"method (round {rounds})" if paper else \
            f"method (round {rounds}; {scale:,.0f} vectors a trial, m = {scale:,.0f} / n)"
        lines += [f"| {head} | " + ("paper | " if paper else "") + " | ".join(f"n={n}" for n in counts) + " |",
                  "|---|" + "---|" * (len(counts) + paper)]
        for method in sorted(rows["method"].unique()):
            cells = []
            for n in counts:
                bounds = rows[(rows["method"] == method) & (rows["n_workers"] == n)]["bound"]
                cells.append("-" if bounds.empty else f"{bounds.mean():.2f} ± {bounds.std(ddof=0):.2f}"
                             if len(bounds) > 1 else f"{bounds.mean():.2f}")
            trials = rows[rows["method"] == method]["trial"].nunique()
            lines.append(f"| {method} ({trials} trials) | " + (f"{PAPER_HERDING.get(method, '-')} | " if paper else "")
                         + " | ".join(cells) + " |")
        lines.append("")
    return lines


def last_values(runs, metric) -> dict:
    """{(key columns..., sorter): [each run's value at its last epoch]} for runs that logged `metric`."""
    runs = runs.dropna(subset=[metric]) if metric in runs else runs.iloc[:0]
    last = runs.sort_values("epoch").groupby("run_dir").tail(1)
    return last.groupby(["partition", "node_cnt", "B", "sorter"])[metric].apply(list).to_dict()


def heterogeneity_table(df) -> list[str]:
    """Final train loss and test accuracy per --partition (rows, least to most skew) and sorter (columns)."""
    runs = df[(df["study"] == "heterogeneity") & (df["benchmark"] == "LR-HMDA")]
    if runs.empty:
        return []
    sorters = sorted(runs["sorter"].unique())
    order = sorted(runs["partition"].unique(), key=partition_order)
    lines = [f"| LR-HMDA, epoch {int(runs['epoch'].max())} | metric | " + " | ".join(sorters) + " |",
             "|---|---|" + "---|" * len(sorters)]
    for metric in ("train_loss", "test_acc"):
        values = last_values(runs, metric)
        for partition in order:
            cells = [mean_std(v for key, vs in values.items() if key[0] == partition and key[3] == sorter for v in vs)
                     for sorter in sorters]
            lines.append(f"| {partition} | {metric} | " + " | ".join(cells) + " |")
    return lines + [""]


def scaling_table(df) -> list[str]:
    """Per benchmark and worker count: final train loss, headline metric and last-epoch herding bound per sorter."""
    lines = []
    for benchmark, metric in (("LR-HMDA", "test_acc"), ("MLP-M4", "test_smape")):
        runs = df[(df["study"] == "scaling") & (df["benchmark"] == benchmark)]
        if runs.empty:
            continue
        sorters = sorted(runs["sorter"].unique())
        lines += [f"| {benchmark}, epoch {int(runs['epoch'].max())} | metric | " + " | ".join(sorters) + " |",
                  "|---|---|" + "---|" * len(sorters)]
        for column in ("train_loss", metric, "herding_bound"):
            values = last_values(runs, column)
            for n, B in sorted(runs[["node_cnt", "B"]].drop_duplicates().itertuples(index=False)):
                cells = [mean_std(v for key, vs in values.items() if key[1:] == (n, B, sorter) for v in vs)
                         for sorter in sorters]
                lines.append(f"| n={n}, B={B} | {column} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def communication_markdown(df) -> list[str]:
    """The communication study (issue #9): per sorter, synchronisation rule and reducer, the final train loss
    and headline metric (mean over seeds), what the run sent, and seconds per epoch against every-step."""
    table = communication_table(df)
    if table.empty:
        return []
    lines = []
    for benchmark, rows in table.groupby("benchmark", sort=False):
        metric = rows["metric"].iloc[0]
        lines += [f"| {benchmark}, epoch {int(rows['epochs'].max())} | sync | reducer | train loss | {metric} | "
                  "GB sent | averagings | mean H | density | s / epoch | vs every-step |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in rows.itertuples():
            lines.append(f"| {row.sorter} | {row.sync} | {row.reducer} | {row.train_loss:.5f} ± {row.train_loss_std:.5f} | "
                         f"{row.final:.2f} ± {row.final_std:.2f} | "
                         f"{row.gigabytes:.3f} | {row.syncs:,.0f} | {row.mean_H:.2f} | {row.density:.4f} | "
                         f"{row.epoch_seconds:.1f} | {row.seconds_vs_every_step:.2f} |")
        lines.append(f"(seeds per row: {', '.join(str(n) for n in sorted(set(rows['seeds'])))})")
        lines.append("")
    return lines


def sketching_markdown(df) -> list[str]:
    """The sketching study (issue #20), per benchmark and group of runs (same workers, batch, learning rate
    and data): per variant (exact CD-GraB, each D, D-RR) at the group's last epoch, the train loss and its
    gain over D-RR as a share of exact CD-GraB's, the herding bound of the real gradients (last epoch and
    mean over epochs 2 on) when logged, and the bytes sent per epoch against D-RR's."""
    lines = []
    for benchmark in sorted(df.loc[df["study"] == "sketching", "benchmark"].unique()) if len(df) else []:
        runs = sketching_runs(df, benchmark)
        for examples, group in runs.groupby("examples"):
            last = int(group["epoch"].max())
            data = f"first {int(examples):,} training examples" if examples else "full data"
            herding = group["herding_bound"].notna().any() if "herding_bound" in group else False
            lines += [f"| {benchmark}, {data}, epoch {last} | train loss | gain over D-RR vs exact's | "
                      + ("herding bound | herding, mean of epochs 2+ | " if herding else "")
                      + "MB per epoch | bytes vs D-RR |",
                      "|---|---|---|" + ("---|---|" if herding else "") + "---|---|"]
            at_last = group[group["epoch"] == last]
            loss = {v: rows["train_loss"] for v, rows in at_last.groupby("variant")}
            mb = {v: rows["comm_bytes"].mean() / 1e6 for v, rows in group.groupby("variant")}
            drr, exact = loss.get("D-RR"), loss.get("CD-GraB exact")
            for variant in sorted(loss, key=variant_order):
                share = "-"
                if drr is not None and exact is not None and variant != "D-RR":
                    share = f"{(drr.mean() - loss[variant].mean()) / (drr.mean() - exact.mean()):.0%}"
                cells = [variant, mean_std(loss[variant]), share]
                if herding:
                    rows = group[group["variant"] == variant]
                    later = rows[rows["epoch"] >= 2].groupby("run_dir")["herding_bound"].mean()
                    cells += [mean_std(rows.loc[rows["epoch"] == last, "herding_bound"]), mean_std(later)]
                cells += [f"{mb[variant]:.1f}", f"{mb[variant] / mb['D-RR']:.2f}x" if "D-RR" in mb else "-"]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    return lines


def sketching_ratio_markdown(df) -> list[str]:
    """The sketching study's herding bounds as multiples of exact CD-GraB's of the same seed
    (analysis.aggregate.herding_ratios), per benchmark and data, one row per variant (the CountSketch and the
    structured map of each D, D-RR): the ratio of the mean over epochs 2 on and of the last epoch, seed by
    seed, with their min and max, and whether every seed's ratio is within issue #31's 1.25x."""
    lines = []
    for benchmark in sorted(df.loc[df["study"] == "sketching", "benchmark"].unique()) if len(df) else []:
        ratios = herding_ratios(sketching_runs(df, benchmark))
        ratios = ratios[ratios["variant"] != "CD-GraB exact"].dropna(subset=["mean_ratio", "last_ratio"])
        for examples, group in ratios.groupby("examples"):
            data = f"first {int(examples):,} training examples" if examples else "full data"
            seeds = sorted(group["seed"].unique())
            names = ", ".join(str(int(seed)) for seed in seeds)
            lines += [f"| {benchmark}, {data}: herding bound / exact CD-GraB's (same seed) | epochs 2+ mean, seeds "
                      f"{names} | min - max | last epoch, seeds {names} | min - max | <= 1.25x on every seed (2+ mean; last) |",
                      "|---|---|---|---|---|---|"]
            for variant in sorted(group["variant"].unique(), key=variant_order):
                rows = group[group["variant"] == variant].set_index("seed")
                cells = [variant]
                for column in ("mean_ratio", "last_ratio"):
                    cells += [" / ".join(f"{rows[column].get(seed, float('nan')):.2f}" for seed in seeds),
                              f"{rows[column].min():.2f} - {rows[column].max():.2f}"]
                cells.append("; ".join("yes" if (rows[column] <= 1.25).all() else "no"
                                       for column in ("mean_ratio", "last_ratio")))
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    return lines


def reorderers_markdown(df) -> list[str]:
    """The reorderers study (issue #21), per benchmark and worker count: per sorter (the study's and the
    CD-GraB and D-RR baselines of the same settings) the train loss and headline metric at the paper's
    epochs and, when later, at the runs' last two epochs (mean per seed, then mean ± std over seeds), and
    the median seconds per epoch; then each sorter's train loss minus CD-GraB's, seed by seed (the same
    seed: the same data split, initial model and first order)."""
    lines = []
    for benchmark in sorted(df.loc[df["study"] == "reorderers", "benchmark"].unique()) if len(df) else []:
        runs = reorderer_runs(df, benchmark)
        metric = headline_metrics(runs, benchmark)[0]
        last = int(runs["epoch"].max())
        spans = [tuple(PAPER_VALUES[benchmark][0])]
        if spans[0][-1] < last:
            spans.append((last - 1, last))
        names = [("epochs " if len(span) > 1 else "epoch ") + "-".join(map(str, span)) for span in spans]
        lines += [f"| {benchmark} | workers | seeds | " + " | ".join(f"train loss, {name} | {metric}, {name}"
                                                               for name in names) + " | s / epoch (median) |",
                  "|---|---|---|" + "---|---|" * len(spans) + "---|"]
        differences = []
        for n, group in runs.groupby("node_cnt"):
            sorters = sorted(group["sorter"].unique(), key=reorderer_order)
            at = {span: group[group["epoch"].isin(span)].groupby(["sorter", "seed"])[["train_loss", metric]].mean()
                  for span in spans}
            for sorter in sorters:
                rows = group[group["sorter"] == sorter]
                cells = [sorter, str(n), ",".join(str(int(seed)) for seed in sorted(rows["seed"].unique()))]
                for span in spans:
                    cells += [mean_std(at[span].loc[sorter, "train_loss"]), mean_std(at[span].loc[sorter, metric])]
                cells.append(f"{rows['epoch_seconds'].median():.1f}")
                lines.append("| " + " | ".join(cells) + " |")
            final = at[spans[-1]]["train_loss"].unstack("sorter")
            for sorter in sorters:
                if sorter == "CD-GraB" or "CD-GraB" not in final:
                    continue
                gap = (final[sorter] - final["CD-GraB"]).dropna()
                differences.append(f"| {n} | {sorter} | {', '.join(f'{v:+.5f}' for v in gap)} | "
                                   f"{int((gap < 0).sum())} of {len(gap)} |")
        lines += ["", f"| {benchmark}, workers | sorter | train loss minus CD-GraB's, {names[-1]}, per seed | "
                      "seeds where lower than CD-GraB |", "|---|---|---|---|", *differences, ""]
    return lines


def leaderboard_markdown(df, bench_file=LEADERBOARD_BENCH) -> list[str]:
    """The leaderboard (issue #60), per benchmark: every orderer with finished runs of the paper's settings
    (analysis.aggregate.leaderboard_runs: the benchmark's own and the reorderers study's), best final
    train loss first: what it needs beyond plain training, its seeds, the final train loss and headline
    metric (mean ± population std over seeds at the runs' last epoch), the first epoch at which its mean
    train loss over seeds is at most D-RR's final one ("never" if it does not get there), and its seconds
    per epoch and peak memory over D-RR's: from bench_file's run labelled by the benchmark's name
    (bench/epoch_time.py --record; "-" for an orderer it lacks), else the median seconds per epoch of the
    runs' own logs over D-RR's and no memory. A line under each table says where its ratios come from."""
    bench_runs = leaderboard_bench(bench_file)
    table, _ = leaderboard(leaderboard_runs(df, load_configs(df)), bench_runs) if len(df) else (None, None)
    lines = []
    for benchmark, rows in table.groupby("benchmark", sort=True) if table is not None else []:
        metric, epoch = rows["metric"].iloc[0], int(rows["epoch"].max())
        source = rows["time_source"].iloc[0]
        lines += [f"| {benchmark}, epoch {epoch} | needs | seeds | final train loss | final {metric} | "
                  f"epoch reaching D-RR's final train loss ({rows['target'].iloc[0]:.5f}) | "
                  f"s / epoch vs D-RR ({source}) | peak memory vs D-RR (bench) |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in rows.itertuples():
            reaches = "never" if row.reaches != row.reaches else str(int(row.reaches))
            seeds = seed_list(row.seed_list).split(" ", 1)[1]  # "seeds 0-4": 0-4
            lines.append(f"| {row.sorter} | {row.needs} | {seeds} | "
                         f"{_plus_minus(row.train_loss, row.train_loss_std)} | "
                         f"{_plus_minus(row.final, row.final_std)} | {reaches} | {_ratio(row.seconds_ratio)} | "
                         f"{_ratio(row.memory_ratio)} |")
        # a blank line first: a line right under a table would render as one of its rows
        lines += ["", bench_caption(benchmark, bench_runs.get(benchmark), Path(bench_file), source), ""]
    return lines


def bench_caption(benchmark: str, run: dict | None, bench_file: Path, source: str) -> str:
    """The line under a leaderboard table that says where its seconds and memory ratios come from."""
    inside = bench_file.resolve().is_relative_to(REPO_ROOT)
    name = bench_file.resolve().relative_to(REPO_ROOT).as_posix() if inside else str(bench_file)
    if source != "bench":
        return (f"{benchmark}'s seconds: its runs' own logs (metrics.csv), not a side-by-side bench ({name} has "
                f"no run \"{benchmark}\" with D-RR); peak memory: not measured.")
    drr = next(spec for spec in run["seconds"] if spec.partition(":")[0] == "D-RR")
    mib = run.get("peak_rss_mib", {}).get(drr)
    with_args = "; ".join(f"{spec.partition(':')[0]} with {' '.join(args)}"
                          for spec, args in run.get("sorter_args", {}).items() if args)
    return (f"{benchmark}'s seconds and peak memory: {name}, run \"{benchmark}\" (bench/epoch_time.py: epoch "
            f"{run['epoch_reported']} of {run['epochs']}-epoch runs, median of {run['rounds']} round"
            f"{'s' * (run['rounds'] != 1)}, one process "
            f"each, side by side; commit {str(run.get('git_commit', '?'))[:7]}, {run.get('date', '?')}; D-RR "
            f"{run['seconds'][drr]['epoch_seconds']:.2f} s per epoch"
            + (f", peak {mib:.0f} MiB" if mib is not None else "") + ")" + (f"; {with_args}." if with_args else "."))


def _ratio(value: float) -> str:
    """A ratio to D-RR with two decimals; NaN (not measured): '-'."""
    return f"{value:.2f}" if value == value else "-"


def _plus_minus(mean: float, std: float) -> str:
    """'mean ± std' with mean_std's digits; one seed (std NaN): the mean alone."""
    digits = 5 if abs(mean) < 10 else 2
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if std == std else f"{mean:.{digits}f}"


def main():
    parser = OneLineErrorParser(prog="python scripts/reproduction_tables.py", description=__doc__.split("\n\n")[0],
                                epilog="Prints Markdown to stdout.")
    parser.add_argument("results_dir", nargs="?", metavar="RESULTS_DIR",
                        help="folder searched recursively for run directories (and RESULTS_DIR/herding for the "
                             "herding simulation's CSVs); default: results/ when it holds runs, else the shipped "
                             "reproduction/")
    args = parser.parse_args()
    root = Path(args.results_dir) if args.results_dir else default_results_dir()
    if not root.is_dir():
        parser.error(f"RESULTS_DIR {root} is not a folder; give a folder that holds run directories (searched "
                     "recursively), or none for the default")
    everything = load_runs(root, include_incomplete=True, warn=False)
    df = everything[everything["study"] == ""]  # the benchmarks' own runs; the studies have their own tables
    alone = alone_epochs(root)
    for benchmark in PAPER_VALUES:
        print("\n".join(benchmark_table(df, benchmark, alone)))
        if benchmark == "LSTM-Wiki2":
            print("\n".join(lstm_setting.markdown(lstm_setting.decide(root))) + "\n")
    print("\n".join(herding_table(load_herding(root / "herding", warn=False))))
    print("\n".join(heterogeneity_table(everything)))
    print("\n".join(scaling_table(everything)))
    print("\n".join(communication_markdown(everything)))
    print("\n".join(sketching_markdown(everything)))
    print("\n".join(sketching_ratio_markdown(everything)))
    print("\n".join(reorderers_markdown(everything)))
    print("\n".join(leaderboard_markdown(everything)))


if __name__ == "__main__":
    main()
