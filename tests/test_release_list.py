"""Every test marked `tests.helpers.release_check` runs somewhere: the test command skips them, so
scripts/release_checks.py (.ci/run) must name each file that holds one (the file, or a test of it)."""
import ast
import re

from tests.helpers import REPO


def release_tests() -> list[str]:
    """The pytest node ids of scripts/release_checks.py's `release_tests` list, read from its source."""
    tree = ast.parse((REPO / "scripts" / "release_checks.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "release_tests" for t in node.targets):
            return [ast.literal_eval(item) for item in node.value.elts]
    raise AssertionError("scripts/release_checks.py has no release_tests list")


def test_every_file_with_a_release_check_is_run_by_the_release_checks():
    listed = release_tests()
    marked = sorted(path.relative_to(REPO).as_posix() for path in (REPO / "tests").glob("test_*.py")
                    if path.name != "test_release_list.py"  # (its own pattern below)
                    and re.search(r"^\s*@release_check\b|marks=release_check\b", path.read_text(), re.M))
    assert "tests/test_fsdp.py" in marked  # the pattern finds the marks
    for path in marked:
        assert any(entry == path or entry.startswith(path + "::") for entry in listed), \
            f"{path} has release checks that scripts/release_checks.py never runs"
    for entry in listed:
        assert (REPO / entry.split("::")[0]).is_file(), f"scripts/release_checks.py names a missing {entry}"
