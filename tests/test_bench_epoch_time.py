"""bench/epoch_time.py --record: a run is written into a results file's "runs" without losing the others."""
import importlib.util
import json

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
