"""Release checks: the wheel and the sdist of `cdgrab-sorters` as users get them (.ci/run, after the tests).

    python scripts/release_checks.py               # every check, in a temporary folder removed afterwards
    python scripts/release_checks.py --keep DIR    # ... in DIR, kept (the wheel and sdist in DIR/dist)

1. a clean copy of the tree: git's files (tracked, and untracked ones git does not ignore), or without
   git (a source archive) the tree less what runs, builds and installs write. Nothing is built in the
   checkout itself, so a stale build/lib/ there can never ship;
2. `python -m build --no-isolation` of that copy: the sdist and the wheel;
3. their metadata: name, version (= sorters.__version__), licence and licence file, the readme
   (docs/package-readme.md, whole), Python and package requirements, classifiers: pyproject.toml's;
4. the wheel's files: exactly the package's modules (byte for byte the copy's), py.typed and the
   .dist-info (with LICENSE); the sdist's: the package, its metadata files and MANIFEST.in's library-only
   tests, whose imports are the library's only;
5. the sdist unpacked elsewhere: its tests pass there, against the sdist's own `sorters`;
6. the wheel installed into a fresh virtual environment away from the source tree (torch and the other
   requirements taken from this interpreter's site-packages through a .pth file, offline: pip resolves
   the requirements against them and installs nothing but the wheel); from a folder outside the checkout,
   with `python -I`: every module of the installed package imports (from the venv), the own-loop example
   (examples/standalone/own_loop.py) trains, and the docs' quick-start snippets run
   (tests/test_docs_blocks.py: quick_start_programs);
7. type check (mypy), lint (ruff), the API reference (Sphinx, warnings as errors, every public name in it)
   and the documented `pip install .` into a fresh venv: the tests marked `release_check`, which the test
   command skips.

Each step prints its wall time. A failed check: one line naming it (and the tool's output), exit 1.
"""
import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import zipfile
from email.parser import Parser as MetadataParser
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the checkout's tests/ (the docs' quick-start snippets) and common/

from common.errors import OneLineErrorParser  # noqa: E402

# the data the release-check tests read (the compiled step trains on real data): this checkout's, by the rule of
# tests/helpers.py ($CDGRAB_DATA, else ../shared/data beside the checkout), not the clean copy's neighbour
DATA_DIR = Path(os.environ.get("CDGRAB_DATA") or REPO / ".." / "shared" / "data").resolve()
# what a checkout may hold that is not the project's (a copy without git leaves these out)
NOT_SOURCE = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", "build", "dist", "results",
              "figures", "datasets", "mutants", "gpu-data", ".ipynb_checkpoints"}
# modules a library-only test may import besides the standard library (transformers, accelerate: the [hf]
# extra's; tests.helpers: the suite's helpers, which import the standard library and pytest only)
LIBRARY_TEST_IMPORTS = {"sorters", "torch", "numpy", "pytest", "transformers", "accelerate", "tests"}
LIBRARY_TEST_HELPERS = {"tests", "tests.helpers"}


class CheckFailed(Exception):
    """A release check that did not hold: its one line, and the output that shows why."""

    def __init__(self, line: str, output: str = ""):
        super().__init__(line)
        self.output = output


def run(cmd: list, *, cwd, env=None, timeout: float = 900, what: str) -> subprocess.CompletedProcess:
    """cmd in cwd; CheckFailed naming `what` (with the output's tail) unless it exits 0."""
    result = subprocess.run([str(word) for word in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode != 0:
        raise CheckFailed(f"{what}: exit {result.returncode}", (result.stdout + result.stderr)[-6000:])
    return result


def clean_env() -> dict:
    """This environment without what would let a child see the checkout or a user's site-packages."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    return {**env, "PYTHONNOUSERSITE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "OMP_NUM_THREADS": "1"}


# ------------------------------------------------------------------------------------------- 1. clean copy
def source_files(tree: Path) -> list[Path]:
    """The tree's source files, relative: git's view where `tree` is a git work tree (tracked files and the
    untracked ones it does not ignore, present on disk), else every file; never one under NOT_SOURCE (a
    tool's cache that .gitignore misses), *.egg-info or a virtual environment (a folder holding pyvenv.cfg)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=tree,
                            capture_output=True) if (tree / ".git").exists() and shutil.which("git") else None
    if listed is not None and listed.returncode == 0:
        names = [Path(name) for name in listed.stdout.decode().split("\0") if name]
        return [name for name in names if (tree / name).is_file() and not (tree / name).is_symlink()
                and not NOT_SOURCE.intersection(name.parts)]
    files = []
    for folder, dirs, names in os.walk(tree):
        dirs[:] = [d for d in dirs if d not in NOT_SOURCE and not d.endswith(".egg-info")
                   and not (Path(folder) / d / "pyvenv.cfg").exists()]
        files += [(Path(folder) / name).relative_to(tree) for name in names if not name.endswith((".pyc", ".pyo"))]
    return files


def clean_copy(tree: Path, folder: Path) -> Path:
    for name in source_files(tree):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / name, folder / name)
    return folder


# ------------------------------------------------------------------------------------------- 3. metadata
def project_of(source: Path) -> dict:
    return tomllib.loads((source / "pyproject.toml").read_text())["project"]


def version_of(source: Path) -> str:
    """sorters.__version__ as sorters/__init__.py writes it (read, not imported: no torch needed)."""
    found = re.search(r'^__version__\s*=\s*"([^"]+)"', (source / "sorters" / "__init__.py").read_text(), flags=re.M)
    if not found:
        raise CheckFailed("sorters/__init__.py: no `__version__ = \"X.Y.Z\"` line")
    return found.group(1)


def normalized(requirement: str) -> str:
    """'numpy >= 2.4 ; extra == "hf"' -> 'numpy>=2.4;extra=="hf"': spaces and quote style set aside."""
    return re.sub(r"\s+", "", requirement).replace("'", '"')


def expected_requirements(project: dict) -> set[str]:
    wanted = {normalized(req) for req in project.get("dependencies", [])}
    for extra, reqs in project.get("optional-dependencies", {}).items():
        wanted |= {normalized(f'{req}; extra == "{extra}"') for req in reqs}
    return wanted


def check_metadata(text: str, project: dict, version: str, readme: str, where: str) -> list[str]:
    """What in the METADATA / PKG-INFO `text` differs from pyproject's [project] (and the version, readme)."""
    meta = MetadataParser().parsestr(text)
    problems = []

    def expect(field, got, wanted):
        if got != wanted:
            problems.append(f"{where}: {field} is {got!r}, expected {wanted!r}")

    expect("Name", meta["Name"], project["name"])
    expect("Version", meta["Version"], version)
    expect("License-Expression", meta["License-Expression"], project["license"])
    expect("License-File", meta.get_all("License-File"), project["license-files"])
    expect("Requires-Python", meta["Requires-Python"], project["requires-python"])
    expect("Summary", meta["Summary"], project["description"])
    expect("Classifier", meta.get_all("Classifier"), project["classifiers"])
    expect("Keywords", (meta["Keywords"] or "").split(","), project["keywords"])
    expect("Description-Content-Type", meta["Description-Content-Type"], "text/markdown")
    expect("the readme (the description)", (meta.get_payload() or "").strip(), readme.strip())
    expect("Requires-Dist", {normalized(req) for req in meta.get_all("Requires-Dist") or []},
           expected_requirements(project))
    expect("Provides-Extra", set(meta.get_all("Provides-Extra") or []), set(project.get("optional-dependencies", {})))
    return problems


# ------------------------------------------------------------------------------------------- 4. contents
def package_files(source: Path) -> dict[str, bytes]:
    """'sorters/...': bytes of every file the package ships: its modules (any depth) and py.typed."""
    root = source / "sorters"
    files = {f"sorters/{path.relative_to(root).as_posix()}": path.read_bytes() for path in root.rglob("*.py")
             if "__pycache__" not in path.parts}
    files["sorters/py.typed"] = (root / "py.typed").read_bytes()
    return files


def check_wheel_files(wheel: Path, source: Path, project: dict, version: str) -> list[str]:
    """The wheel holds exactly the package's files, byte for byte the source's, and its .dist-info."""
    info = f"{project['name'].replace('-', '_')}-{version}.dist-info"
    wanted = package_files(source)
    expected_info = {f"{info}/{name}" for name in ("METADATA", "WHEEL", "RECORD", "top_level.txt")}
    expected_info |= {f"{info}/licenses/{name}" for name in project["license-files"]}
    problems = []
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for name in sorted(names - set(wanted) - expected_info):
            problems.append(f"{wheel.name}: holds {name}, which the package does not have (a stale build?)")
        for name in sorted(set(wanted) - names):
            problems.append(f"{wheel.name}: lacks {name}")
        for name in sorted(expected_info - names):
            problems.append(f"{wheel.name}: lacks {name}")
        for name in sorted(set(wanted) & names):
            if archive.read(name) != wanted[name]:
                problems.append(f"{wheel.name}: {name} differs from the source's")
        for name in sorted(expected_info & names):
            if "/licenses/" in name and archive.read(name) != (source / name.split("/licenses/", 1)[1]).read_bytes():
                problems.append(f"{wheel.name}: {name} differs from the source's")
        if f"{info}/top_level.txt" in names and archive.read(f"{info}/top_level.txt").split() != [b"sorters"]:
            problems.append(f"{wheel.name}: top_level.txt is not `sorters` alone")
    return problems


def manifest_tests(source: Path) -> list[str]:
    """The test files MANIFEST.in puts in the sdist ('tests/...'), in its order."""
    listed = []
    for line in (source / "MANIFEST.in").read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words[:1] == ["include"]:
            listed += [word for word in words[1:] if word.startswith("tests/")]
    return listed


def non_library_imports(path: Path) -> list[str]:
    """The imports of the test file `path` that are neither the standard library nor LIBRARY_TEST_IMPORTS
    (of tests/, only LIBRARY_TEST_HELPERS): anywhere in a test_*.py file, at module level in the suite's
    shared files (tests/helpers.py imports the engine inside the helpers of the entry scripts' tests only)."""
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in (ast.walk(tree) if path.name.startswith("test_") else tree.body):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            continue
        for module in modules:
            top = module.split(".")[0]
            if top == "tests" and module not in LIBRARY_TEST_HELPERS:
                found.append(module)
            elif top not in LIBRARY_TEST_IMPORTS and top not in sys.stdlib_module_names:
                found.append(module)
    return found


def check_sdist_files(sdist: Path, source: Path, project: dict, version: str) -> list[str]:
    """The sdist holds the package (byte for byte), its metadata files and MANIFEST.in's library-only tests,
    and nothing else of the checkout."""
    top = f"{project['name'].replace('-', '_')}-{version}"
    egg = f"{project['name'].replace('-', '_')}.egg-info"
    wanted = {name: data for name, data in package_files(source).items()}
    for name in ["pyproject.toml", "MANIFEST.in", "pytest.ini", project["readme"], *project["license-files"],
                 *manifest_tests(source), *(["CHANGELOG.md"] if (source / "CHANGELOG.md").exists() else [])]:
        wanted[name] = (source / name).read_bytes()
    generated = {"PKG-INFO", "setup.cfg"} | {f"{egg}/{name}" for name in
                                             ("PKG-INFO", "SOURCES.txt", "dependency_links.txt", "requires.txt",
                                              "top_level.txt")}
    problems = []
    with tarfile.open(sdist) as archive:
        members = {member.name.removeprefix(f"{top}/"): member for member in archive.getmembers() if member.isfile()}
        for name in sorted(set(members) - set(wanted) - generated):
            problems.append(f"{sdist.name}: holds {name}, which is not the package, its metadata or a library-only test")
        for name in sorted(set(wanted) - set(members)):
            problems.append(f"{sdist.name}: lacks {name}")
        for name in sorted(set(wanted) & set(members)):
            if archive.extractfile(members[name]).read() != wanted[name]:
                problems.append(f"{sdist.name}: {name} differs from the source's")
    for name in manifest_tests(source):
        if non_library_imports(source / name):
            problems.append(f"MANIFEST.in: {name} imports {', '.join(non_library_imports(source / name))}: not a "
                            "library-only test (it would fail from the unpacked sdist)")
    return problems


# ------------------------------------------------------------------------------------------- 6. fresh venv
IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys
from pathlib import Path
import sorters
site = Path(sys.argv[1]).resolve()
names = ["sorters"] + [info.name for info in pkgutil.walk_packages(sorters.__path__, "sorters.")]
for name in names:
    module = importlib.import_module(name)
    where = Path(module.__file__).resolve()
    assert where.is_relative_to(site), f"{name} imported from {where}, not from the venv's {site}"
assert sorters.__version__ == sys.argv[2], (sorters.__version__, sys.argv[2])
print(len(names), "modules:", " ".join(names))
"""


def fresh_venv(folder: Path) -> tuple[Path, Path]:
    """A virtual environment in `folder` that sees this interpreter's site-packages (torch, numpy, numba,
    transformers, lightning: the wheel cache's) through a .pth file, as --system-site-packages sees the
    base interpreter's; (its python, its site-packages). Without pip and setuptools of its own: a venv's
    bundled setuptools (65.5 on Python 3.11) would shadow the one torch requires (>= 77.0.3); this
    interpreter's pip installs into it (`pip --python`)."""
    run([sys.executable, "-m", "venv", "--without-pip", folder], cwd=folder.parent, env=clean_env(),
        what="python -m venv")
    python = folder / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=folder.parent,
                    env=clean_env(), what="the venv's site-packages").stdout.strip())
    ours = [path for path in sys.path if Path(path).name in ("site-packages", "dist-packages")]
    (site / "the-release-checks-packages.pth").write_text("".join(f"{path}\n" for path in ours))
    return python, site


def check_installed(wheel: Path, work: Path, version: str) -> None:
    python, site = fresh_venv(work / "venv")
    env = clean_env()
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-index", f"{wheel}[hf,lightning]"], cwd=work,
        env=env, what=f"pip install --no-index {wheel.name}[hf,lightning] in a fresh venv")
    if list(site.glob("torch*")) or list(site.glob("numpy*")):
        raise CheckFailed("pip installed a torch or numpy of its own into the fresh venv (expected the cached ones)")
    elsewhere = work / "elsewhere"  # outside the checkout and the venv: -I keeps both the cwd and $PYTHONPATH off
    elsewhere.mkdir()
    imported = run([python, "-I", "-c", IMPORT_EVERY_MODULE, site, version], cwd=elsewhere, env=env,
                   what="the import of every module of the installed package")
    print(f"   {imported.stdout.strip()}")
    example = shutil.copy(REPO / "examples" / "standalone" / "own_loop.py", elsewhere / "own_loop.py")
    trained = run([python, "-I", example, "--epochs", "2", "--replicas", "2"], cwd=elsewhere, env=env,
                  what="examples/standalone/own_loop.py from the installed wheel")
    losses = [float(x) for x in re.findall(r"train loss ([0-9.]+)", trained.stdout)]
    if len(losses) != 2 or not losses[1] < losses[0]:
        raise CheckFailed("examples/standalone/own_loop.py: expected 2 epochs with a falling train loss", trained.stdout)
    print(f"   own_loop.py --epochs 2 --replicas 2: train loss {losses[0]:.4f} -> {losses[1]:.4f}")
    from tests.test_docs_blocks import quick_start_programs
    for name, program in quick_start_programs():
        script = elsewhere / f"quick_start_{re.sub(r'[^A-Za-z0-9]+', '_', name)}.py"
        script.write_text(program)
        run([python, "-I", script], cwd=elsewhere, env=env, what=f"the quick start of {name} from the installed wheel")
        print(f"   the quick start of {name} ran")


# ------------------------------------------------------------------------------------------- the steps
def step(title: str, times: list):
    """A context that prints the step's title and, at its end, its wall time."""
    import contextlib

    @contextlib.contextmanager
    def timed():
        print(f"-- {title}", flush=True)
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        times.append((title, seconds))
        print(f"   {seconds:.1f} s", flush=True)
    return timed()


def release_checks(work: Path) -> list:
    times = []
    python_env = clean_env()
    with step("1. a clean copy of the tree", times):
        source = clean_copy(REPO, work / "source")
        project, version = project_of(source), version_of(source)
        readme = (source / project["readme"]).read_text()
    with step("2. python -m build (sdist and wheel) of the copy", times):
        dist = work / "dist"
        run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, source], cwd=source, env=python_env,
            what="python -m build --no-isolation")
        for written in [source / "build", *source.glob("*.egg-info")]:  # the copy stays a source tree (step 7)
            shutil.rmtree(written, ignore_errors=True)
        base = f"{project['name'].replace('-', '_')}-{version}"
        wheel, sdist = dist / f"{base}-py3-none-any.whl", dist / f"{base}.tar.gz"
        if sorted(dist.iterdir()) != sorted([sdist, wheel]):
            raise CheckFailed(f"the build wrote {sorted(p.name for p in dist.iterdir())}, expected {sdist.name} and "
                              f"{wheel.name} (version {version}: sorters.__version__)")
    with step("3. the metadata of the wheel and the sdist", times):
        with zipfile.ZipFile(wheel) as archive:
            problems = check_metadata(archive.read(f"{base}.dist-info/METADATA").decode(), project, version, readme,
                                      wheel.name)
        with tarfile.open(sdist) as archive:
            problems += check_metadata(archive.extractfile(f"{base}/PKG-INFO").read().decode(), project, version,
                                       readme, sdist.name)
        if problems:
            raise CheckFailed(f"{len(problems)} metadata problem(s): {problems[0]}", "\n".join(problems))
    with step("4. the files of the wheel and the sdist", times):
        problems = check_wheel_files(wheel, source, project, version) + check_sdist_files(sdist, source, project,
                                                                                          version)
        if problems:
            raise CheckFailed(f"{len(problems)} content problem(s): {problems[0]}", "\n".join(problems))
    with step("5. the sdist's tests, from the unpacked sdist", times):
        unpacked = work / "sdist"
        with tarfile.open(sdist) as archive:
            archive.extractall(unpacked, filter="data")
        tests = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=unpacked / base,
                    env=python_env, what="the sdist's tests (pytest in the unpacked sdist)")
        print(f"   {tests.stdout.strip().splitlines()[-1]}")
    with step("6. the wheel in a fresh venv, run from outside the checkout", times):
        check_installed(wheel, work, version)
    with step("7. type check, lint, API reference", times):
        # the type check, the linter and the generated reference, with the commands docs/api.md states, and the
        # documented `pip install .` into a fresh venv: the tests marked tests.helpers.release_check (skipped
        # in the test command, which they would lengthen), run here in the clean copy, so that no cache or
        # build lands in the checkout
        release_tests = ["tests/test_types_and_lint.py", "tests/test_reference.py", "tests/test_packaging.py",
                         "tests/test_fsdp.py",  # the tiny GPT-2 sharded with fully_shard
                         # fully_shard's options: reshard to 2 of 4 processes, the tiny GPT-2's root resharded, in bf16
                         "tests/test_fsdp_options.py::test_reshard_after_forward_to_a_smaller_mesh",
                         "tests/test_fsdp_options.py::test_gpt2_blocks_kept_and_root_resharded",
                         "tests/test_fsdp_options.py::test_bf16_records_give_float64_products_of_the_bf16_forward[gpt2]",
                         "tests/test_compiled_step.py",  # --compile inductor: ~20 s of C++ compiling per run
                         # the tiny GPT-2's sharded checkpoint and resume (with the file's MLP-M4 cases, ~25 s)
                         "tests/test_fsdp_resume.py",
                         # the FSDP bench at a small size: its layout, FSDP's bytes from the parameters' shapes
                         "tests/test_fsdp_bench.py::test_report_layout_and_fsdps_bytes_from_the_parameters",
                         # the HF Trainer's structured sketches under Accelerate's FSDP2, 2 processes
                         "tests/test_fsdp_frameworks.py::test_hf_trainer_under_accelerates_fsdp2_gives_one_process_orders"
                         "[sketch]",
                         "tests/test_reproduction.py::test_analysis_draws_the_reproduction_figures"]
        checked = run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *release_tests],
                      cwd=source, env={**python_env, "CDGRAB_RELEASE_CHECKS": "1", "CDGRAB_DATA": str(DATA_DIR)},
                      what="the release-check tests (mypy, ruff, the reference's build, the documented install)")
        print(f"   {checked.stdout.strip().splitlines()[-1]}")
    return times


def main(argv=None) -> int:
    parser = OneLineErrorParser(prog="scripts/release_checks.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", metavar="DIR", default=None,
                        help="work in DIR (new or empty) and keep it: dist/ (the wheel and sdist), the venv, ...")
    args = parser.parse_args(argv)
    if args.keep is not None:
        work = Path(args.keep).resolve()
        if work.exists() and (not work.is_dir() or any(work.iterdir())):
            parser.error(f"--keep {args.keep}: not a new or empty folder")
        if work.is_relative_to(REPO):
            parser.error(f"--keep {args.keep}: inside the checkout; give a folder outside it")
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="cdgrab-release-checks-"))
    start = time.perf_counter()
    try:
        release_checks(work)
    except CheckFailed as failure:
        if failure.output:
            print(failure.output, file=sys.stderr)
        print(f"release check failed: {failure}", file=sys.stderr)
        return 1
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"release checks passed in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
