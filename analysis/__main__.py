"""python -m analysis [RESULTS_DIR] --out figures/ : draw every figure the results allow, print the table.

Without RESULTS_DIR: results/ when it holds runs, else the full-scale runs shipped in reproduction/.

Walks RESULTS_DIR for run directories (config.json + metrics.csv), reports unreadable, unfinished
and duplicate runs and expected sorters without runs (never fails on them), saves PNG + PDF
figures (see analysis/plots.py for the names), prints the final-metric table and writes it to
<out>/final-metrics.csv. Exit status 0 unless the arguments are wrong (then one line and status 2: a
RESULTS_DIR that is no folder, an --out that is a file or inside a run folder: it never writes into one).
"""
import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; must precede the pyplot import in analysis.plots

from analysis import (EXPECTED_SORTERS, aggregate_all, default_results_dir, format_table, load_configs,  # noqa: E402
                      load_herding, load_runs, missing_sorters)
from analysis.load import SHIPPED_RESULTS  # noqa: E402
from analysis.plots import draw_all  # noqa: E402
from common.errors import UserFacingError, exit_with_error  # noqa: E402
from engine.rundir import RUN_FILES, check_out_path  # noqa: E402


class OneLineParser(argparse.ArgumentParser):
    """A bad command line in one line (argparse prints the usage block first), status 2."""

    def error(self, message):
        exit_with_error(f"{message}; see python -m analysis --help")


def check_paths(args) -> None:
    """One line (UserFacingError) for a RESULTS_DIR that is no folder, and an --out that cannot be a folder of
    figures or lies in a run folder (one holding config.json, metrics.csv or checkpoint.pt)."""
    if not Path(args.results_dir).is_dir():
        raise UserFacingError(f"{args.results_dir} is not a folder (no such folder, or a file); give the folder "
                              "that holds the run folders, e.g. results/")
    out = check_out_path(args.out).resolve()
    for folder in (out, *out.parents):
        if any((folder / name).is_file() for name in RUN_FILES if name != "orders.pt"):
            raise UserFacingError(f"--out {args.out} is inside the run folder {folder}, and the analysis never "
                                  "writes into run folders; choose another --out (default figures/)")


def main(argv=None) -> int:
    try:
        return analyse(argv)
    except UserFacingError as error:
        exit_with_error(str(error))


def analyse(argv=None) -> int:
    p = OneLineParser(prog="python -m analysis", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results_dir", nargs="?", default=None,
                   help="folder searched recursively for run dirs (default: results/ when it holds runs, "
                        "else the shipped reproduction/)")
    p.add_argument("--out", default="figures", help="folder for the PNG/PDF figures and final-metrics.csv "
                                                    "(default figures/)")
    p.add_argument("--band", choices=["std", "minmax"], default="std",
                   help="shaded band around the mean over seeds/trials: mean ± 1 std (default) or min–max")
    p.add_argument("--herding-dir", default=None,
                   help="folder with herding simulation CSVs (scripts/herding_simulation.py); "
                        "default RESULTS_DIR/herding")
    p.add_argument("--include-incomplete", action="store_true",
                   help="also plot unfinished runs (fewer metrics.csv rows than args.epochs); they are reported either "
                        "way. On by default for the shipped reproduction/, whose GPU runs (LSTM-Wiki2, GPT2-Wiki103) "
                        "grow session by session")
    p.add_argument("--expect-sorters", nargs="+", default=list(EXPECTED_SORTERS), metavar="SORTER",
                   help=f"sorters every benchmark should have; missing ones are reported (default {' '.join(EXPECTED_SORTERS)})")
    args = p.parse_args(argv)
    if args.results_dir is None:
        args.results_dir = str(default_results_dir())
    check_paths(args)
    if Path(args.results_dir).resolve() == SHIPPED_RESULTS.resolve():
        args.include_incomplete = True  # the partial GPU runs are drawn as far as they got (REPRODUCTION.md)

    # load -> aggregate -> draw: the run folders are read here once, every table made once, then drawn
    df, problems = load_runs(args.results_dir, include_incomplete=args.include_incomplete,
                             with_problems=True, warn=False)
    herding_dir = Path(args.herding_dir) if args.herding_dir else Path(args.results_dir) / "herding"
    hdf, herding_problems = load_herding(herding_dir, with_problems=True, warn=False)
    if args.herding_dir is None and not herding_dir.is_dir():
        herding_problems = []  # the default location is optional
    print(f"{df['run_dir'].nunique() if len(df) else 0} runs loaded from {args.results_dir}, "
          f"{len(hdf)} herding rows from {herding_dir}")

    configs = load_configs(df)
    tables = aggregate_all(df, hdf, configs, band=args.band)
    written = draw_all(tables, args.out)
    table = tables.final
    Path(args.out).mkdir(parents=True, exist_ok=True)
    table.to_csv(Path(args.out) / "final-metrics.csv", index=False)

    print("\nFinal metric (last epoch, mean ± std over seeds):")
    print(format_table(table))
    notes = [str(x) for x in problems + herding_problems] + missing_sorters(df, sorters=args.expect_sorters)
    if not len(hdf):
        notes.append(f"no herding simulation CSVs in {herding_dir} (run scripts/herding_simulation.py)")
    if notes:
        print(f"\nReported ({len(notes)}):")
        for note in notes:
            print(f"  - {note}")
    print(f"\nWrote {len(written)} figure files to {args.out}/")
    for path in written:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
