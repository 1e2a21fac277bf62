"""examples/standalone/: one example per entry point (own loop, torchrun, HF Trainer, Lightning) on synthetic
data, importing nothing of the repository but `sorters` (scripts/release_checks.py runs the own-loop one
from the installed wheel). Here they run from the checkout for a few steps, each against another launch of
the same training: torchrun's 2 processes against the own loop's 2 replicas in one process, Lightning
against the own loop (one replica), and the Trainer's loss against its own first epoch."""
import ast
import os
import re
import sys

import pytest

from tests.helpers import REPO, run_python

STANDALONE = REPO / "examples" / "standalone"
EXAMPLES = ("own_loop.py", "torchrun_ddp.py", "hf_trainer.py", "lightning_trainer.py")


def run_example(name, *args, tmp_path, nproc=None):
    """The example from an empty folder, `sorters` from the checkout (PYTHONPATH), one thread per process."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    result = run_python([sys.executable, *launcher, STANDALONE / name, *args], cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, f"{name}: exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    assert list(tmp_path.iterdir()) == [], f"{name} wrote {sorted(p.name for p in tmp_path.iterdir())}"
    return result.stdout


def epochs(stdout: str) -> list[tuple[float, str]]:
    """(train loss, the orders' first examples) of each 'epoch e/E | train loss L | first examples ...' line."""
    return [(float(loss), orders) for loss, orders in
            re.findall(r"^epoch \d+/\d+ \| train loss ([0-9.]+) \| first examples per replica (.*)$", stdout, flags=re.M)]


def test_each_imports_only_sorters_torch_and_its_framework():
    allowed = {"sorters", "torch", "transformers", "lightning"}
    for name in EXAMPLES:
        tree = ast.parse((STANDALONE / name).read_text())
        modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        outside = {m for m in modules if m.split(".")[0] not in allowed | set(sys.stdlib_module_names)}
        assert not outside, f"{name} imports {sorted(outside)}: a standalone example needs the installed package only"


def test_torchrun_equals_the_own_loop_with_two_replicas_in_one_process(tmp_path):
    """2 gloo processes (one replica each) and one process hosting both: the same orders, the same losses
    (to rounding), and CD-GraB's loss falls."""
    one = epochs(run_example("own_loop.py", "--epochs", "2", "--replicas", "2", tmp_path=tmp_path))
    two = epochs(run_example("torchrun_ddp.py", "--epochs", "2", tmp_path=tmp_path, nproc=2))
    assert len(one) == len(two) == 2
    assert [orders for _, orders in one] == [orders for _, orders in two]
    assert [loss for loss, _ in one] == pytest.approx([loss for loss, _ in two], abs=2e-4)
    assert one[1][0] < one[0][0]
    assert one[0][1] != one[1][1], "CD-GraB's second epoch has an order of its own"


@pytest.mark.slow
def test_lightning_equals_the_own_loop(tmp_path):
    """Lightning's loop (CDGraBCallback) and the own loop: the same orders and losses, one replica."""
    own = epochs(run_example("own_loop.py", "--epochs", "2", tmp_path=tmp_path))
    lit = epochs(run_example("lightning_trainer.py", "--epochs", "2", tmp_path=tmp_path))
    assert len(own) == len(lit) == 2
    assert [orders for _, orders in own] == [orders for _, orders in lit]
    assert [loss for loss, _ in own] == pytest.approx([loss for loss, _ in lit], abs=2e-4)


@pytest.mark.slow
def test_the_hf_trainer_example_trains(tmp_path):
    out = run_example("hf_trainer.py", "--epochs", "2", "--examples", "32", tmp_path=tmp_path)
    losses = [float(loss) for loss in re.findall(r"^epoch \d+/2 \| train loss ([0-9.]+)$", out, flags=re.M)]
    assert len(losses) == 2 and losses[1] < losses[0], out
    first = re.search(r"^last epoch's first examples per replica \[\[([0-9, ]+)\]\]$", out, flags=re.M)
    assert first and len(set(map(int, first.group(1).split(", ")))) == 6, out


@pytest.mark.parametrize("args,message", [
    (["--batch-size", "0"], "batch_size"),
    (["--examples", "8", "--batch-size", "16"], "too few for"),
    (["--sorter", "GraB"], "invalid choice: 'GraB'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = run_python([sys.executable, STANDALONE / "own_loop.py", *args], cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    (line,) = result.stderr.splitlines()
    assert message in line, line
