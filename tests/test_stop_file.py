"""$CDGRAB_STOP_FILE: a run stops cleanly after the epoch the file names (or the current one when it is
empty), exit 0, and --resume continues it to the same metrics as an uninterrupted run; under torchrun
the processes agree even when only one of them could read the file."""
import pytest

from tests.helpers import check_ok, needs_data, read_metrics, run_script

pytestmark = [needs_data("hmda/raw/hmda_train_preprocessed.zip"), pytest.mark.slow]
TINY = ["--sorter", "CD-GraB", "--node_cnt", "2", "--B", "4", "--max-train-examples", "64",
        "--max-eval-examples", "64", "--epochs", "3"]
COMPARED = ("train_loss", "test_loss", "train_acc", "test_acc")


def losses(run):
    return [[row[k] for k in COMPARED] for row in read_metrics(run)]


@pytest.mark.parametrize("content,stops_after", [("2\n", 2), ("", 1), ("9\n", 3)])
def test_stop_file_stops_after_the_named_epoch_and_resume_continues(tmp_path, content, stops_after):
    stop = tmp_path / "stop"
    stop.write_text(content)
    run = tmp_path / "run"
    result = run_script("main-LR-HMDA.py", *TINY, "--out", run, env={"CDGRAB_STOP_FILE": str(stop)})
    check_ok(result)
    assert len(read_metrics(run)) == stops_after
    assert ("stopped after epoch" in result.stderr) == (stops_after < 3)
    check_ok(run_script("main-LR-HMDA.py", *TINY, "--out", run, "--resume"))
    oracle = tmp_path / "oracle"
    check_ok(run_script("main-LR-HMDA.py", *TINY, "--out", oracle))
    assert losses(run) == losses(oracle)


def test_torchrun_processes_agree_on_the_stop(tmp_path):
    """Rank 1 is given a path that never exists: rank 0's request must still stop both (else they part
    ways and the next epoch's collectives hang)."""
    stop = tmp_path / "stop"
    stop.write_text("1\n")
    run = tmp_path / "run"
    wrapper = tmp_path / "per_rank_stop.py"
    wrapper.write_text(
        "import os, runpy, sys\n"
        "if os.environ.get('RANK') != '0':\n"
        "    os.environ['CDGRAB_STOP_FILE'] = os.environ['CDGRAB_STOP_FILE'] + '.absent'\n"
        "sys.argv = sys.argv[1:]\n"
        "sys.path[0] = os.getcwd()  # the entry script's folder, as if it were run itself\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    result = run_script(str(wrapper), "main-LR-HMDA.py", *TINY, "--backend", "gloo", "--dist-timeout", "60", "--out", run,
                        nproc=2,
                        env={"CDGRAB_STOP_FILE": str(stop)}, timeout=300)
    check_ok(result)
    assert len(read_metrics(run)) == 1
