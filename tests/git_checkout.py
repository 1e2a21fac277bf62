"""Whether these tests run in a git checkout, as the tests' own oracle: a source archive (`git archive`) or
an unpacked sdist has no .git, and then every commit the suite records is "unknown commit"
(engine/runlog.py, docs/run-directory.md). Tests whose subject is this checkout's git history skip there
(needs_git_history); tests/test_provenance.py checks the provenance itself both ways in temporary copies."""
import subprocess

import pytest

from tests.helpers import REPO

UNKNOWN_COMMIT = "unknown commit"
GIT_CHECKOUT = (REPO / ".git").exists()  # a directory, or a file in a worktree or submodule
needs_git_history = pytest.mark.skipif(
    not GIT_CHECKOUT, reason="reads this checkout's git history, and this copy has no .git (a source archive); "
                             "tests/test_provenance.py checks the no-git case")


def git(*argv: str) -> str:
    """git's stdout in this checkout (which must be one)."""
    return subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True, check=True).stdout


def expected_head() -> str:
    """HEAD's commit as git itself gives it here; "unknown commit" in a copy without .git."""
    return git("rev-parse", "HEAD").strip() if GIT_CHECKOUT else UNKNOWN_COMMIT
