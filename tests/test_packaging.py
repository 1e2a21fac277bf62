"""pyproject.toml: `pip install .` gives a `sorters` package that works outside the checkout, and only that."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import REPO, release_check

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


def wheel_of_the_installed(name: str, folder: Path) -> Path:
    """A wheel of distribution `name` as installed in this interpreter, written to `folder`: a wheel is a
    zip of the installed files with their .dist-info (METADATA, WHEEL, RECORD), so the files listed in its
    RECORD, bytecode caches left out, make one."""
    import importlib.metadata
    import zipfile

    dist = importlib.metadata.distribution(name)
    tag = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-py3-none-any.whl"
    with zipfile.ZipFile(folder / tag, "w", zipfile.ZIP_DEFLATED) as wheel:
        for file in dist.files:
            if "__pycache__" not in file.parts and not file.name.endswith(".pyc"):
                wheel.write(file.locate(), str(file))
    return folder / tag


def require_setuptools_that_builds_wheels():
    """Fail in one line unless this interpreter's setuptools makes wheels by itself (>= 70.1; an older one
    needs the `wheel` package, which a fresh venv lacks: "invalid command 'bdist_wheel'") and reads the SPDX
    licence fields of pyproject.toml (>= 77). torch 2.13.0 requires setuptools >= 77.0.3, so the README's
    set-up brings one."""
    import importlib.metadata

    version = importlib.metadata.version("setuptools")
    if tuple(int(part) for part in version.split(".")[:2]) < (77, 0):
        pytest.fail(f"setuptools {version} here, older than 77.0.3 (no SPDX licence fields): "
                    "pip install -r requirements.txt (torch 2.13.0 brings setuptools >= 77.0.3)", pytrace=False)


def documented_install() -> list[list[str]]:
    """docs/sampler.md's install commands, as `pip install` argument lists: the ```bash block under
    '## Install' (torch first, then the package), then the offline command its text gives."""
    import re
    import shlex

    page = (REPO / "docs" / "sampler.md").read_text()
    section = page[page.index("## Install\n"):page.index("\n## ", page.index("## Install\n") + 1)]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    block_pips = [words[2:] for words in lines if words[:2] == ["pip", "install"]]
    offline = re.findall(r"`pip install (--no-index --no-build-isolation \.)`", section)
    assert len(offline) == 1, "docs/sampler.md: the offline command `pip install --no-index --no-build-isolation .`"
    return block_pips + [offline[0].split()]


def test_the_documented_install_puts_torch_first():
    """`pip install .` given no torch takes the newest from the index (on Linux the CUDA build, GBs), so
    the documented commands install the pinned torch before the package (test_the_documented_install_...
    cannot see the order: its venv has torch either way)."""
    steps = documented_install()
    torch_steps = [i for i, step in enumerate(steps) if any(word.startswith("torch==") for word in step)]
    package_steps = [i for i, step in enumerate(steps) if step[-1:] == ["."]]
    assert torch_steps and package_steps and torch_steps[0] < package_steps[0], steps
    assert any(word == "torch==2.13.0" for word in steps[torch_steps[0]]), "the version requirements.txt pins"


@release_check
def test_the_documented_install_in_a_fresh_venv(tmp_path):
    """docs/sampler.md's commands (read from the page) in a fresh virtual environment, offline, in their
    order: `pip install torch==2.13.0`, `pip install .` (build isolation on), then the offline
    `pip install --no-index --no-build-isolation .` (built from a copy of the checkout). The install is the
    `sorters` package alone with its requirements (check_installed_distribution), and it works outside the
    checkout: imported with -I from another folder, from the venv's site-packages, not from the checkout's
    sorters/ (sys.path may hold other folders inside the checkout: a virtual environment made there puts its
    site-packages on it; that is where torch comes from, and it holds no `sorters` of the checkout's), without
    the engine, and CD-GraB balances with its compiled (numba) sign loop.

    What running them offline needs, and nothing more:
    - torch, numpy and numba already there, so that pip fetches none: the venv sees this suite's
      site-packages through a .pth file, as `--system-site-packages` would see the base interpreter's
      (which lacks torch when the suite itself runs from a venv). Without torch present, `pip install .`
      would fetch one: on PyPI, the CUDA build.
    - one wheel, of setuptools >= 77.0.3, in a folder given with --no-index --find-links. The venv's own
      pip and setuptools come first on its path: the ones venv bundles (ensurepip), a new user's; on
      Python 3.11 that setuptools is 65.5, which satisfies neither torch 2.13.0's requirement
      `setuptools>=77.0.3` (so `pip install torch==2.13.0` installs the wheel into the venv: what a user
      gets from the index) nor makes wheels by itself (>= 70.1; hence "invalid command 'bdist_wheel'" when
      `--no-build-isolation .` comes before torch). The isolated build of `pip install .` takes
      `setuptools>=64` (pyproject.toml) from the same folder. The wheel is made from the setuptools this
      suite runs with (torch 2.13.0's requirement again), so the test needs no wheel cache of the
      machine's, and no network."""
    require_setuptools_that_builds_wheels()
    steps = documented_install()
    source, venv, wheels, elsewhere = (tmp_path / name for name in ("source", "venv", "wheels", "elsewhere"))
    copy_of_the_checkout(source)
    wheels.mkdir(), elsewhere.mkdir()
    wheel_of_the_installed("setuptools", wheels)
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    where = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                           capture_output=True, text=True, check=True)
    site = Path(where.stdout.strip())
    ours = [path for path in sys.path if Path(path).name in ("site-packages", "dist-packages")]
    (site / "the-suites-packages.pth").write_text("".join(f"{path}\n" for path in ours))
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1"}
    for step in steps:
        pip = subprocess.run([str(python), "-m", "pip", "install", "--no-index", "--find-links", str(wheels), *step],
                             cwd=source, env=env, capture_output=True, text=True, timeout=300)
        assert pip.returncode == 0, f"pip install {' '.join(step)}:\n{pip.stdout}{pip.stderr}"
    assert (site / "sorters" / "__init__.py").is_file()
    assert not list(site.glob("torch*")) and not list(site.glob("nvidia*")), "pip installed a torch of its own"
    check_installed_distribution(site)
    check = textwrap.dedent(f"""
        import importlib.util, sys
        from pathlib import Path
        assert {str(REPO)!r} not in [str(Path(p).resolve()) for p in sys.path], sys.path  # -I and cwd elsewhere
        import sorters, torch
        from sorters import CDGraBSampler, PerExampleGrads, build_sorter
        where = Path(sorters.__file__).resolve()
        assert where.is_relative_to(Path({str(site)!r}).resolve()), where  # the install's sorters
        assert not where.is_relative_to(Path({str(REPO / "sorters")!r}).resolve()), where  # not the checkout's
        assert importlib.util.find_spec("engine") is None  # the engine stays in the checkout
        assert sorted(build_sorter("D-RR", 2, 4, 3).sort()[1].tolist()) == [0, 1, 2, 3]
        sorter = build_sorter("CD-GraB", 2, 4, 3)
        assert sorted(sorter.sort()[1].tolist()) == [0, 1, 2, 3]
        sorter.step(torch.randn(2, 2, 3), range(0, 2))
        sorter.step(torch.randn(2, 2, 3), range(2, 4))  # the compiled (numba) sign loop, compiled in the venv
        second = sorter.sort()
        assert sorted(second[0].tolist()) == [0, 1, 2, 3] and second.shape == (2, 4)
        print(where)
    """)
    result = subprocess.run([str(python), "-I", "-c", check], cwd=elsewhere, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str((site / "sorters" / "__init__.py").resolve())


def check_installed_distribution(site: Path) -> None:
    """The installed cdgrab-sorters in `site` (its .dist-info): its files are the `sorters` package alone
    (RECORD), and what it pulls in (METADATA) is torch, numpy and numba, the frameworks only through the
    extras hf and lightning."""
    (info,) = site.glob("cdgrab_sorters-*.dist-info")
    files = [line.rsplit(",", 2)[0] for line in (info / "RECORD").read_text().splitlines() if line.strip()]
    top = {Path(file).parts[0] for file in files if not Path(file).parts[0].endswith(".dist-info")}
    assert top == {"sorters"}, sorted(top)
    requires = [line.split(":", 1)[1].strip() for line in (info / "METADATA").read_text().splitlines()
                if line.startswith("Requires-Dist:")]
    base = sorted(requirement.split(">")[0] for requirement in requires if "extra ==" not in requirement)
    assert base == ["numba", "numpy", "torch"], requires
    extras = {requirement.split("extra ==")[1].strip().strip("'\"") for requirement in requires if "extra ==" in requirement}
    assert extras == {"hf", "lightning"}, requires


# ------------------------------------------------------------------ the release checks' own checks (fast: no build)
def release_checks():
    """scripts/release_checks.py as a module (it builds nothing when imported)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("release_checks", REPO / "scripts" / "release_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", ["as built", "stale file", "changed module", "no py.typed", "no licence"])
def test_the_wheel_contents_check_finds_what_a_stale_build_ships(tmp_path, case):
    """A wheel written here from the checkout's package as setuptools lays one out, and broken as a stale
    build/lib/ or a lost package-data entry would break it: the check names exactly the file."""
    import zipfile

    checks = release_checks()
    project = {"name": "cdgrab-sorters", "license-files": ["LICENSE"]}
    info = "cdgrab_sorters-9.9.9.dist-info"
    files = {path.relative_to(REPO).as_posix(): path.read_bytes() for path in (REPO / "sorters").rglob("*.py")
             if "__pycache__" not in path.parts}
    files |= {"sorters/py.typed": b"", f"{info}/METADATA": b"", f"{info}/WHEEL": b"", f"{info}/RECORD": b"",
              f"{info}/top_level.txt": b"sorters\n", f"{info}/licenses/LICENSE": (REPO / "LICENSE").read_bytes()}
    expected = []
    if case == "stale file":
        files["sorters/removed_long_ago.py"] = b"x = 1\n"
        expected = ["holds sorters/removed_long_ago.py, which the package does not have (a stale build?)"]
    elif case == "changed module":
        files["sorters/sampler.py"] += b"\n# an older build's copy\n"
        expected = ["sorters/sampler.py differs from the source's"]
    elif case == "no py.typed":
        del files["sorters/py.typed"]
        expected = ["lacks sorters/py.typed"]
    elif case == "no licence":
        del files[f"{info}/licenses/LICENSE"]
        expected = [f"lacks {info}/licenses/LICENSE"]
    wheel = tmp_path / "cdgrab_sorters-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    problems = checks.check_wheel_files(wheel, REPO, project, "9.9.9")
    assert [problem.split(": ", 1)[1] for problem in problems] == expected


def test_the_sdists_tests_need_only_the_library(tmp_path):
    """MANIFEST.in's test files exist and import only the library, torch, numpy, pytest, transformers and
    tests/helpers.py (what the unpacked sdist holds); a test importing the engine is caught."""
    checks = release_checks()
    listed = checks.manifest_tests(REPO)
    assert {"tests/conftest.py", "tests/helpers.py", "tests/test_sorters.py"} <= set(listed), listed
    assert all((REPO / name).is_file() for name in listed), listed
    assert {name: checks.non_library_imports(REPO / name) for name in listed} == {name: [] for name in listed}
    engine_test = tmp_path / "test_engine_thing.py"
    engine_test.write_text("import torch\nfrom tests.test_sampler import x\n\ndef test_it():\n    from engine.comm import C\n")
    assert checks.non_library_imports(engine_test) == ["tests.test_sampler", "engine.comm"]


def test_the_compatibility_table_is_what_ci_runs():
    """docs/compatibility.md's CI row is requirements.txt's pins, and its Python pyproject's lower bound."""
    import re
    import tomllib

    pins = dict(line.split("#")[0].strip().split("==") for line in (REPO / "requirements.txt").read_text().splitlines()
                if "==" in line.split("#")[0])
    page = (REPO / "docs" / "compatibility.md").read_text()
    header = re.search(r"^\| run \|(.*)\|$", page, flags=re.M).group(1)
    row = re.search(r"^\| CI: `requirements.txt`'s pins \|(.*)\|$", page, flags=re.M).group(1)
    columns = [cell.strip().lower() for cell in header.split("|")]
    cells = [cell.strip().split(" ")[0] for cell in row.split("|")]
    table = dict(zip(columns, cells))
    python = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert table.pop("python") == python.removeprefix(">=")
    assert table == {name: pins[name] for name in table}, (table, pins)
    assert set(table) == {"torch", "numpy", "numba", "transformers", "accelerate", "lightning"}
