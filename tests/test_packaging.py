"""pyproject.toml: `pip install .` gives a `sorters` package that works outside the checkout, and only that."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow  # a pip build, and numba compiling CD-GraB's sign loop in a fresh folder


def copy_of_the_checkout(folder):
    """The checkout's files in `folder`, to build from (a build writes build/ and *.egg-info beside its
    source): without git's folder, caches, run outputs, the shipped runs (4 MB the build never reads), and
    any virtual environment (a folder holding pyvenv.cfg, such as the .venv that .gitignore lists)."""
    import shutil

    skipped = shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "build", "*.egg-info", "results",
                                     "figures", "datasets", "reproduction")

    def ignore(directory, names):
        return set(skipped(directory, names)) | {name for name in names
                                                 if (Path(directory) / name / "pyvenv.cfg").exists()}

    shutil.copytree(REPO, folder, ignore=ignore)
    return folder


def test_pip_install_gives_the_sorters_package_alone(tmp_path):
    """Built from a copy of the checkout, offline: --no-build-isolation uses the installed setuptools
    instead of fetching one. Then imported from another folder, with the checkout's own folder off sys.path:
    `sorters` must come from the install, not from the checkout's sorters/. (sys.path may hold other folders
    inside the checkout: a virtual environment made there, `python -m venv .venv`, puts its site-packages on
    it; that is where torch comes from, and it holds no `sorters` of the checkout's.)"""
    source, target, elsewhere = tmp_path / "source", tmp_path / "installed", tmp_path / "elsewhere"
    copy_of_the_checkout(source)
    elsewhere.mkdir()
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(source)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert sorted(path.name for path in target.iterdir() if not path.name.endswith(".dist-info")) == ["sorters"]
    (metadata,) = target.glob("*.dist-info/METADATA")
    requires = [line.split(":", 1)[1].strip() for line in metadata.read_text().splitlines()
                if line.startswith("Requires-Dist:")]
    assert sorted(requirement.split(">")[0] for requirement in requires) == ["numba", "numpy", "torch"]

    check = textwrap.dedent(f"""
        import importlib.util, sys
        from pathlib import Path
        sys.path.insert(0, {str(target)!r})
        assert {str(REPO)!r} not in [str(Path(p).resolve()) for p in sys.path], sys.path  # -I and cwd elsewhere
        import torch
        import sorters
        from sorters import CDGraBSampler, PerExampleGrads, build_sorter
        sorter = build_sorter("CD-GraB", 2, 4, 3)
        assert sorted(sorter.sort()[1].tolist()) == [0, 1, 2, 3]
        sorter.step(torch.randn(2, 2, 3), range(0, 2))
        sorter.step(torch.randn(2, 2, 3), range(2, 4))  # the compiled (numba) sign loop
        second = sorter.sort()
        assert sorted(second[0].tolist()) == [0, 1, 2, 3] and second.shape == (2, 4)
        assert importlib.util.find_spec("engine") is None  # the engine stays in the checkout
        where = Path(sorters.__file__).resolve()
        assert where.is_relative_to(Path({str(target)!r}).resolve()), where  # the install's sorters
        assert not where.is_relative_to(Path({str(REPO / "sorters")!r}).resolve()), where  # not the checkout's
        print(sorters.__file__)
    """)
    # -I: no PYTHONPATH, no user site-packages, no script folder on sys.path
    result = subprocess.run([sys.executable, "-I", "-c", check], cwd=elsewhere, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(target / "sorters" / "__init__.py")

