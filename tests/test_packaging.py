"""pyproject.toml: `pip install .` gives a `sorters` package that works outside the checkout, and only that."""
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow  # a pip build, and numba compiling CD-GraB's sign loop in a fresh folder


def test_pip_install_gives_the_sorters_package_alone(tmp_path):
    """Built from a copy of the checkout (the build writes build/ and *.egg-info beside its source), offline:
    --no-build-isolation uses the installed setuptools instead of fetching one. Then imported from another
    folder with the checkout off sys.path."""
    import shutil

    source, target, elsewhere = tmp_path / "source", tmp_path / "installed", tmp_path / "elsewhere"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", ".pytest_cache", "build", "*.egg-info", "results", "figures", "datasets",
        "reproduction"))  # (the shipped runs: 4 MB the build never reads)
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
        sys.path.insert(0, {str(target)!r})
        assert not any(p.startswith({str(REPO)!r}) for p in sys.path), sys.path
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
        print(sorters.__file__)
    """)
    # -I: no PYTHONPATH, no user site-packages, no script folder on sys.path
    result = subprocess.run([sys.executable, "-I", "-c", check], cwd=elsewhere, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(target / "sorters" / "__init__.py")
