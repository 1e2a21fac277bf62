"""bench/epoch_time.py: medians, peak memory per run (each child's own) and sorter arguments against a stand-in entry
script with known seconds and memory; one-line errors; --record writes a run into a results file's "runs" without
losing the others."""
import importlib.util
import json
import subprocess
import sys

import pytest

from tests.helpers import REPO


def load_bench():
    spec = importlib.util.spec_from_file_location("epoch_time", REPO / "bench" / "epoch_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_record_adds_a_run_keeps_the_others_and_their_commit(tmp_path):
    bench = load_bench()
    path = tmp_path / "cpu-epochs.json"
    path.write_text(json.dumps({"machine": "m", "git_commit": "abc", "date": "2026-01-01",
                                "runs": {"old": {"seconds": {}, "CD-GraB/D-RR": 1.5},
                                         "mine": {"seconds": {}, "CD-GraB/D-RR": 9.0}}}))
    result = {"seconds": {"D-RR": {"epoch_seconds": 2.0}, "CD-GraB": {"epoch_seconds": 1.0}},
              "ratio_to_first": {"D-RR": 1.0, "CD-GraB": 0.5}, "git_commit": "def"}
    bench.record(path, "mine", result, ["D-RR", "CD-GraB"])
    report = json.loads(path.read_text())
    assert report["machine"] == "m" and "git_commit" not in report and "date" not in report
    assert report["runs"]["old"] == {"seconds": {}, "CD-GraB/D-RR": 1.5, "git_commit": "abc", "date": "2026-01-01"}
    assert report["runs"]["mine"] == {**result, "CD-GraB/D-RR": 0.5}  # replaced, with its own commit
    bench.record(tmp_path / "new.json", "first", result, ["D-RR", "CD-GraB"])  # a file that does not exist yet
    assert json.loads((tmp_path / "new.json").read_text())["runs"]["first"]["CD-GraB/D-RR"] == 0.5


# A stand-in for an entry script: the bench's flags, --extra-mib (a sorter argument: that many MiB held
# beyond the 48 every run holds, every page written) and --state (a file that counts its runs per sorter,
# i.e. the bench's round); the epoch seconds are SECONDS[sorter] * ROUND_FACTORS[round] * epoch.
FAKE_ENTRY = '''
import argparse, csv, os
parser = argparse.ArgumentParser()
for flag in ("--sorter", "--out", "--progress", "--state"):
    parser.add_argument(flag)
parser.add_argument("--epochs", type=int)
parser.add_argument("--extra-mib", type=int, default=0)
args = parser.parse_args()
held = b"\\x01" * ((48 + args.extra_mib) << 20)
with open(args.state, "a+") as state:
    state.seek(0)
    round_ = sum(line.strip() == args.sorter for line in state)
    state.write(args.sorter + "\\n")
base = {"D-RR": 2.0, "CD-GraB": 3.0, "Greedy": 5.0}[args.sorter] * (1.0, 1.25, 3.0)[round_]
os.makedirs(args.out)
with open(os.path.join(args.out, "metrics.csv"), "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["epoch", "epoch_seconds", "sorter_seconds", "comm_seconds", "compute_seconds"])
    for epoch in range(1, args.epochs + 1):
        writer.writerow([epoch, base * epoch, 0.5 * epoch, 0.0, base * epoch - 0.5 * epoch])
'''


def test_each_sorter_gets_its_median_seconds_its_own_peak_memory_and_its_arguments(tmp_path):
    """Three rounds of three sorters, one with a sorter argument that holds 64 MiB more: the medians by hand
    (epoch 2 of a 3-epoch run: 2 * base * the median round factor 1.25, neither the first round's nor the
    last's), the ratios to the first sorter, and the memory each run held of its own (the 64 MiB run first,
    so a peak shared across children shows). In a fresh interpreter, as it is used: a child's peak counts
    from the bench process's own (checkout_facts)."""
    script, state = tmp_path / "fake_entry.py", tmp_path / "rounds.txt"
    script.write_text(FAKE_ENTRY)
    out = subprocess.run([sys.executable, str(REPO / "bench" / "epoch_time.py"), str(script), "--sorters",
                          "Greedy:--extra-mib 64", "D-RR", "CD-GraB", "--epochs", "3", "--epoch", "2", "--rounds", "3",
                          "--", "--state", str(state)], capture_output=True, text=True, check=True).stdout
    result = json.loads(out)
    assert {sorter: seconds["epoch_seconds"] for sorter, seconds in result["seconds"].items()} == \
        {"Greedy:--extra-mib 64": 12.5, "D-RR": 5.0, "CD-GraB": 7.5}
    assert result["seconds"]["D-RR"]["sorter_seconds"] == 1.0
    assert result["ratio_to_first"] == {"Greedy:--extra-mib 64": 1.0, "D-RR": 0.4, "CD-GraB": 0.6}
    assert result["sorter_args"] == {"Greedy:--extra-mib 64": ["--extra-mib", "64"], "D-RR": [], "CD-GraB": []}
    peak = result["peak_rss_mib"]
    assert result["bench_process_peak_rss_mib"] < peak["D-RR"], (result["bench_process_peak_rss_mib"], peak)
    assert 56 <= peak["Greedy:--extra-mib 64"] - peak["D-RR"] <= 72, peak  # the 64 MiB it held
    assert abs(peak["CD-GraB"] - peak["D-RR"]) <= 8, peak
    assert result["peak_rss_ratio_to_first"]["D-RR"] == pytest.approx(peak["D-RR"] / peak["Greedy:--extra-mib 64"],
                                                                       abs=1e-3)
    assert state.read_text().split() == ["Greedy", "D-RR", "CD-GraB"] * 3  # interleaved rounds


def test_a_failed_run_and_a_bad_sorter_are_one_line_each(tmp_path, capsys):
    import argparse

    bench = load_bench()
    script = tmp_path / "fake_entry.py"
    script.write_text(FAKE_ENTRY)
    with pytest.raises(bench.BenchError, match="exited with 2: .*error: unrecognized arguments: --no-such-flag$"):
        bench.one_run(str(script), "D-RR:--no-such-flag", 1, ["--state", str(tmp_path / "rounds.txt")],
                      tmp_path / "run")
    parser = argparse.ArgumentParser()
    for sorters, expected in ((["D-RRR"], "--sorters: 'D-RRR' names no sorter; give NAME or NAME:ARGS with NAME "
                                          "one of D-RR, CD-GraB"),
                              (["D-RR", "D-RR"], "--sorters: a sorter is given twice in D-RR D-RR; give each once")):
        with pytest.raises(SystemExit) as exit_:
            bench.check_sorters(parser, sorters, ["D-RR", "CD-GraB"])
        error = capsys.readouterr().err
        assert exit_.value.code == 2 and error.endswith(expected + "\n"), error
