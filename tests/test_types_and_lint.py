"""The linter and the type checker of the library (issue #59), as pyproject.toml configures them: `ruff check`
(sorters/ and the release checks' tests) with 0 findings, and `mypy` (sorters/) with 0 errors. mypy from a cold
cache is slow, so it is a release check (tests.helpers.release_check: scripts/release_checks.py runs it); its cache
goes to a temporary folder, never into the checkout."""
import subprocess
import sys
from pathlib import Path

from tests.helpers import release_check

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    found = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, f"ruff check:\n{found.stdout}{found.stderr}"


@release_check
def test_mypy_finds_nothing(tmp_path):
    checked = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache")],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert checked.returncode == 0, f"mypy:\n{checked.stdout}{checked.stderr}"
