"""docs/compatibility.md's rows against the records scripts/check_compat.py wrote (reproduction/compatibility/):
every record has one row, whose versions and passed/failed/skipped counts are the record's, so the page cannot
drift from what ran; and the script's own parts that need no other torch (its pytest summary reading, its
test selection, its one-line errors)."""
import json
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

PAGE = REPO / "docs" / "compatibility.md"
RECORDS = REPO / "reproduction" / "compatibility"
SCRIPT = REPO / "scripts" / "check_compat.py"
VERSION_COLUMNS = ("Python", "torch", "numpy", "numba", "transformers", "accelerate", "lightning")
COUNTED = ("passed", "failed", "skipped")

sys.path.insert(0, str(REPO / "scripts"))
import check_compat  # noqa: E402


def table_rows(text: str) -> list[dict]:
    """The rows of the page's first table, as {column name: cell}."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
            for line in lines[2:]]


def rows_quoting(rows: list[dict], record_name: str) -> list[dict]:
    return [row for row in rows if f"reproduction/compatibility/{record_name})" in row["run"]]


def check_row_quotes_record(row: dict, record: dict) -> None:
    """The row's version cells begin with the record's versions (without a local label such as +cpu, which the
    cell may say in words); its run cell gives the record's counts."""
    for column in VERSION_COLUMNS:
        expected = record["versions"][column.lower()].split("+")[0]
        assert row[column].split(" ")[0] == expected, f"{column}: the table says {row[column]!r}, the record {expected}"
    quoted = {word: int(number) for number, word in re.findall(r"(\d+) (passed|failed|skipped)\b", row["run"])}
    assert quoted == {word: record["counts"][word] for word in COUNTED}, \
        f"the table's counts {quoted} are not the record's {record['counts']}"


def test_every_record_has_one_row_with_its_versions_and_counts():
    records = sorted(RECORDS.glob("*.json"))
    assert records, "no record in reproduction/compatibility/: run scripts/check_compat.py"
    rows = table_rows(PAGE.read_text())
    for path in records:
        record = json.loads(path.read_text())
        quoting = rows_quoting(rows, path.name)
        assert len(quoting) == 1, f"docs/compatibility.md: {len(quoting)} rows link {path.name}; one should"
        check_row_quotes_record(quoting[0], record)


def test_a_row_that_differs_from_its_record_is_caught():
    """The check above on a row altered in one version, and in one count."""
    record = {"versions": {"python": "3.11.7", "torch": "2.14.1", "numpy": "2.4.6", "numba": "0.68.1",
                           "transformers": "5.23.0", "accelerate": "1.15.0", "lightning": "2.6.6"},
              "counts": {"passed": 780, "failed": 0, "skipped": 2}}
    row = {"run": "[r](../reproduction/compatibility/r.json): 780 passed, 0 failed, 2 skipped", "Python": "3.11.7",
           "torch": "2.14.1 (CUDA build, on the CPU)", "numpy": "2.4.6", "numba": "0.68.1",
           "transformers": "5.23.0", "accelerate": "1.15.0", "lightning": "2.6.6"}
    check_row_quotes_record(row, record)
    with pytest.raises(AssertionError, match="torch"):
        check_row_quotes_record({**row, "torch": "2.14.0 (CUDA build, on the CPU)"}, record)
    with pytest.raises(AssertionError, match="counts"):
        check_row_quotes_record({**row, "run": row["run"].replace("780", "781")}, record)


@pytest.mark.parametrize("path", sorted(RECORDS.glob("*.json")), ids=lambda path: path.name)
def test_each_record_is_the_scripts_whole_record(path):
    """Written by the script: named by its torch, a commit, the command, every count, no failure unlisted."""
    record = json.loads(path.read_text())
    assert path.name == f"torch-{record['versions']['torch'].split('+')[0]}.json"
    assert re.fullmatch("[0-9a-f]{40}", record["commit"]) or record["commit"] == check_compat.UNKNOWN_COMMIT
    assert record["pytest_command"].split()[1:3] == ["-m", "pytest"] and not record["timed_out"]
    assert len(record["failed"]) + len(record["errors"]) == record["counts"]["failed"] + record["counts"]["errors"]
    assert record["wall_seconds"] > 0 and record["versions"]["sorters"]


def test_the_pytest_summary_is_read_word_by_word():
    """Against pytest -q -ra output written out here: counts, failures, errors and skips."""
    output = "\n".join([
        "..F.s.E",
        "=========================== short test summary info ============================",
        "SKIPPED [1] tests/helpers.py:40: no data: hmda/raw/x.zip",
        "FAILED tests/test_sampler.py::test_a[2] - AssertionError: orders differ",
        "ERROR tests/test_sketch.py::test_b - RuntimeError: boom",
        "1 failed, 4 passed, 1 skipped, 3 deselected, 1 error, 2 warnings in 12.50s",
    ])
    summary = check_compat.summarise(output)
    assert summary["counts"] == {"passed": 4, "failed": 1, "skipped": 1, "errors": 1, "deselected": 3,
                                 "xfailed": 0, "xpassed": 0}
    assert summary["failed"] == ["tests/test_sampler.py::test_a[2] - AssertionError: orders differ"]
    assert summary["errors"] == ["tests/test_sketch.py::test_b - RuntimeError: boom"]
    assert summary["skipped"] == ["[1] tests/helpers.py:40: no data: hmda/raw/x.zip"]
    assert check_compat.summarise("....\n(killed)")["counts"] is None  # no summary line: a run cut short


def test_the_selection_names_tests_that_exist():
    """A renamed library test file or engine run shows here, not as a silently smaller selection."""
    assert [test for test in check_compat.LIBRARY_TESTS if not (REPO / test).is_file()] == []
    assert check_compat.stale_deselection(REPO, list(check_compat.ENGINE_RUNS)) is None
    assert check_compat.stale_deselection(REPO, ["tests/test_sketch.py::test_no_such_test"]) is not None


@pytest.mark.parametrize("args,message", [
    (["--python", "/no/such/python"], "--python /no/such/python: no such interpreter"),
    (["--python", sys.executable, "--workers", "-1"], "--workers must be >= 0"),
    (["--python", sys.executable, "--data", "/no/such/folder"], "no data folder /no/such/folder"),
])
def test_bad_arguments_get_one_line(tmp_path, args, message):
    # --timeout 1: a check that let bad input through would start pytest, stopped at once
    result = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "r.json"), "--timeout", "1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: ") and message in line, line
    assert list(tmp_path.iterdir()) == []


def test_help_describes_every_flag():
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("usage: scripts/check_compat.py")
    for flag in ("--python", "--out", "--overwrite", "--tree", "--tests", "--with-engine-runs", "--workers",
                 "--data", "--timeout", "--log"):
        # the flag, its metavar or choices, then its help: on the same line, or the next one indented
        assert re.search(rf"^  (-\w+ \w+, )?{flag}( \S+)*(  +\S| *\n {{20,}}\S)", result.stdout, flags=re.M), flag
