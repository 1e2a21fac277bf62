"""The package's release metadata: the licence, pyproject.toml's description of the package, one version
(sorters.__version__) that pyproject.toml and CHANGELOG.md agree on, and the changelog's format."""
import re
import tomllib

import sorters
from tests.helpers import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CHANGELOG = (REPO / "CHANGELOG.md").read_text()
VERSION_HEADING = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.M)


def test_the_licence_is_mit_and_said_in_pyproject_and_the_readme():
    assert (REPO / "LICENSE").read_text().startswith("MIT License\n")
    project = PYPROJECT["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert "MIT" in (REPO / "README.md").read_text()


def test_pyproject_describes_the_package():
    project = PYPROJECT["project"]
    assert (REPO / project["readme"]).is_file()
    assert project["authors"] and all(author.get("name") for author in project["authors"])
    assert project["keywords"] and project["description"]
    assert "Typing :: Typed" in project["classifiers"] and (REPO / "sorters" / "py.typed").is_file()
    for classifier in project["classifiers"]:
        if classifier.startswith("Programming Language :: Python :: 3."):
            minor = classifier.rsplit(".", 1)[1]
            assert project["requires-python"] == ">=3." + minor or int(minor) > 11, classifier


def test_one_version_written_once():
    """pyproject.toml reads the version from sorters.__version__ (no second copy to drift)."""
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "sorters.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", sorters.__version__)


def test_the_changelog_names_the_version_and_keeps_its_format():
    """Keep a Changelog: an Unreleased section first, then releases newest first with ISO dates, each
    subsection one of the six kinds; the newest release is sorters.__version__."""
    assert CHANGELOG.index("## [Unreleased]") < CHANGELOG.index("## [" + sorters.__version__ + "]")
    releases = VERSION_HEADING.findall(CHANGELOG)
    assert releases and releases[0][0] == sorters.__version__, releases
    numbers = [tuple(int(part) for part in version.split(".")) for version, _ in releases]
    assert numbers == sorted(numbers, reverse=True) and len(set(numbers)) == len(numbers)
    dates = [date for _, date in releases]
    assert dates == sorted(dates, reverse=True)
    kinds = set(re.findall(r"^### (.+)$", CHANGELOG, flags=re.M))
    assert kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, kinds
    assert all(heading.startswith(("# Changelog", "## [", "### "))
               for heading in re.findall(r"^#.*$", CHANGELOG, flags=re.M))
