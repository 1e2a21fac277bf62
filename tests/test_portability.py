"""The test suite runs for a newcomer: with any interpreter (no `python` or `torchrun` needed on PATH)
and with the data anywhere ($CDGRAB_DATA), skipping data tests that cannot run, unless $CI is set."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# a program started by name is looked up on PATH, which may hold another interpreter or none at all
BARE = re.compile(r"(python[\d.]*|torchrun)$")


def bare_launches(source: str) -> list[str]:
    """Places in a test source that start python or torchrun by name instead of via sys.executable:
    an argv list/tuple whose first item is such a name, a shell command line that begins with one,
    and a PYTHON / TORCHRUN environment value that is one. Lists compared in an assertion (an
    expected argv) start nothing. Returns 'line N: text' for each."""
    tree, found = ast.parse(source), []
    compared = {id(x) for node in ast.walk(tree) if isinstance(node, ast.Compare) for x in [node.left, *node.comparators]}
    for node in ast.walk(tree):
        words = []
        if isinstance(node, (ast.List, ast.Tuple)) and node.elts and isinstance(node.elts[0], ast.Constant) \
                and id(node) not in compared:
            words = [node.elts[0].value]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words = [node.value.split(maxsplit=1)[0]] if node.value.strip() and " " in node.value.strip() else []
        elif isinstance(node, ast.Dict):
            words = [v.value.split()[0] for k, v in zip(node.keys, node.values)
                     if isinstance(k, ast.Constant) and k.value in ("PYTHON", "TORCHRUN")
                     and isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value.split()]
        for word in words:
            if isinstance(word, str) and BARE.match(word):
                found.append(f"line {node.lineno}: {ast.get_source_segment(source, node)[:80]}")
    return found


def test_detector_finds_bare_launches():
    bad = '''
subprocess.run(["python", "main-LR-HMDA.py", "--help"])
subprocess.run(("torchrun", "--standalone", "x.py"))
subprocess.run("python3 -m pytest -q", shell=True)
env = {"PYTHON": "python3.11", "TORCHRUN": "torchrun"}
'''
    assert len(bare_launches(bad)) == 5
    good = '''
"""Run `python <script> args` (or torchrun) from the repo root."""
subprocess.run([sys.executable, "-m", "torch.distributed.run", "x.py"])
versions = {"torch", "torchopt", "python"}
assert argv[:3] == ["torchrun", "--standalone", "--nproc_per_node=4"]
env = {"PYTHON": str(fake), "TORCHRUN": f"{fake} torchrun"}
'''
    assert bare_launches(good) == []


def test_no_test_starts_python_or_torchrun_from_path():
    offenders = {path.name: bare_launches(path.read_text()) for path in sorted(TESTS.glob("*.py"))
                 if path.name != Path(__file__).name}  # this file's detector test has examples on purpose
    assert not {name: hits for name, hits in offenders.items() if hits}, \
        "start subprocesses with sys.executable (and `sys.executable -m torch.distributed.run` for torchrun)"


def run_pytest(test_file: str, **env) -> subprocess.CompletedProcess:
    """pytest on one test file in a fresh interpreter, in one process (-n 0), with these environment
    variables."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-n", "0", "-p", "no:cacheprovider", test_file],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                          capture_output=True, text=True, timeout=300)


def test_missing_data_skips_with_a_hint_and_fails_under_ci(tmp_path):
    """An existing but empty data folder: the data tests skip naming the download script (the
    tests that need no data still pass); with CI set they fail instead."""
    empty = tmp_path / "data"
    empty.mkdir()
    skipped = run_pytest("tests/test_data_wikitext2.py", CDGRAB_DATA=str(empty), CI="")
    output = skipped.stdout + skipped.stderr
    assert skipped.returncode == 0, output
    assert re.search(r"\d+ passed, \d+ skipped", output), output
    assert "scripts/download_data.sh" in output and "wikitext-2/train.txt" in output and str(empty) in output

    failed = run_pytest("tests/test_data_wikitext2.py", CDGRAB_DATA=str(empty), CI="true")
    output = failed.stdout + failed.stderr
    assert failed.returncode == 1, output
    assert "skipped" not in output and "CI is set" in output and "scripts/download_data.sh" in output
