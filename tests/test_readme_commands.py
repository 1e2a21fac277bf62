"""Every command in the ```bash / ```sh blocks of README.md and docs/*.md runs as written after the set-up,
top to bottom (README.md first, then the docs pages by name).

Which commands run (one rule, so a new README command cannot be skipped by accident):
- skipped: `pip ...` (the set-up), `... -m pytest` (the set-up's test command: this suite), `export ...`
  (the set-up's data line: the suite's $CDGRAB_DATA stands in for it), `python -m venv ...` and
  `. <venv>/bin/activate` (making and entering a virtual environment: the suite runs in the environment it
  was started in; tests/test_packaging.py installs into a fresh venv the documented way), shell scripts (`scripts/*.sh`: sweeps
  of many full runs), `jupyter` (notebooks: tests/test_notebooks.py runs them) and `python -m analysis`
  (tests/test_reproduction.py draws the figures with it; here it would add about a minute), `git` (the
  developer's own bookkeeping), `sbatch` (a SLURM job: tests/test_slurm.py renders the template) and
  `scripts/gpu_session.py` (the body of a lent GPU machine's call: tests/test_gpu_session.py runs its
  whole path on the CPU) and `scripts/mutation.py` (mutation testing: hours, a development check outside
  the test command); `python -m mypy`, `python -m ruff` and `python -m sphinx` (docs/api.md's type check,
  linter and reference build: the release checks, scripts/release_checks.py, run them, through the tests
  marked `release_check`);
- every other `python` / `torchrun` command runs, in that order, in one fresh folder that sees the
  checkout's files (so `results/` and `figures/` land there), with the flags of TINY for its target
  appended (a tiny size: the last value of a repeated flag wins); a target TINY does not know fails the
  test, so each new kind of command gets its tiny size chosen here on purpose. A command of a target
  in READ_ONLY that a page repeats word for word (docs/gpus.md's `python scripts/reproduction_tables.py`
  after README.md's) runs once, at its first place: it reads what the first run read and writes nothing.
  Any other repeat runs again (a repeated training command would be refused: a finished run).
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DATA_DIR, REPO, needs_data, run_python

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]  # the order the commands run in
SKIPPED_PROGRAMS = ("pip", "jupyter", "git", "sbatch")
SKIPPED_SCRIPTS = ("scripts/gpu_session.py", "scripts/mutation.py")
RELEASE_TOOLS = (["mypy"], ["ruff"], ["sphinx"])  # docs/api.md's commands: the release checks run them
# appended to a command by the prefix of its target (the script, or `-m module`); {epochs} is 1, or past
# the command's own --warmup-epochs (which must end before the last epoch)
TINY = {  # the first prefix that matches wins; the LSTM and GPT-2 evaluate slowly, so they get less
    "main-LSTM-Wiki2.py": ["--max-train-examples", "8", "--max-eval-examples", "4", "--epochs", "1",
                           "--progress", "off"],
    "main-GPT2-Wiki103.py": ["--max-train-examples", "128", "--max-seq-length", "32", "--max-eval-examples", "4",
                             "--epochs", "1", "--progress", "off"],  # 64 workers x 1 block of 32 tokens: two steps
    "main-": ["--max-train-examples", "128", "--max-eval-examples", "32", "--epochs", "{epochs}",
              "--progress", "off"],
    "examples/lightning_mlp.py": ["--max-train-examples", "64", "--epochs", "1", "--progress", "off"],
    "examples/hf_trainer_gpt2.py": ["--max-train-examples", "32", "--block-size", "16", "--batch-size", "4",
                                    "--epochs", "1", "--progress", "off"],
    "examples/": ["--max-train-examples", "128", "--epochs", "1"],
    "scripts/herding_simulation.py": ["--scale", "0.0005", "--trials", "1", "--rounds", "2", "--workers", "5",
                                      "--out", "results/herding"],  # 500 vectors: a second or two per method
    "scripts/reproduction_tables.py": [],  # reads the shipped reproduction/ and prints
    "-m analysis": [],  # draws what the commands above wrote to results/
}
# targets that only read (the shipped reproduction/) and print: a word-for-word repeat runs once
READ_ONLY = ("scripts/reproduction_tables.py",)
# what the fresh folder leaves out of the checkout: what the commands write
WRITTEN = {"results", "figures", ".git"}


def documented_commands() -> list[list[str]]:
    """The commands of every page in PAGES, README.md's first."""
    return [words for page in PAGES for words in readme_commands(page.read_text())]


def readme_commands(text: str) -> list[list[str]]:
    """The shell commands of the ```bash / ```sh blocks, as argument lists (continuation lines joined,
    comments dropped, quotes removed; $VARS left for run_command to expand)."""
    commands = []
    for block in re.findall(r"^[ \t]*```(?:bash|sh)[ \t]*\n(.*?)^[ \t]*```", text, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def split_env(words: list[str]) -> tuple[dict, list[str]]:
    """Leading VAR=value words, and the rest."""
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, value = words[0].split("=", 1)
        env[key], words = value, words[1:]
    return env, words


def is_skipped(words: list[str]) -> bool:
    _, argv = split_env(words)
    module_run = argv[:2] == ["python", "-m"] and argv[2:3] in (["pytest"], ["analysis"], ["venv"], *RELEASE_TOOLS)
    return (argv[0] in SKIPPED_PROGRAMS or argv[0] in ("export", ".", "source") or module_run
            or any(word.endswith(".sh") for word in argv[:1]) or any(word in SKIPPED_SCRIPTS for word in argv))


def target_of(argv: list[str]) -> str:
    """The script (or `-m module`) a python / torchrun command runs."""
    if argv[0] not in ("python", "torchrun"):
        raise AssertionError(f"README command {shlex.join(argv)!r}: only python and torchrun commands are run "
                             "by this test; skip the program in SKIPPED_PROGRAMS (with a reason) or run it")
    rest = argv[1:]
    if rest[:1] == ["-m"]:
        return f"-m {rest[1]}"
    return next(word for word in rest if not word.startswith("-"))


def tiny_flags(argv: list[str]) -> list[str]:
    target = target_of(argv)
    prefixes = [prefix for prefix in TINY if target.startswith(prefix)]
    assert prefixes, f"README command {shlex.join(argv)!r}: no tiny size for {target!r}; add one to TINY"
    warmup = float(argv[argv.index("--warmup-epochs") + 1]) if "--warmup-epochs" in argv else 0.0
    return [flag.format(epochs=int(warmup) + 1) for flag in TINY[prefixes[0]]]


def run_command(words: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run one README command in cwd with its tiny flags: `python` is this interpreter, `torchrun` is
    `<this interpreter> -m torch.distributed.run` (as everywhere in the tests, through the script server), $VARS expand from the
    environment, whose CDGRAB_DATA is the suite's data folder (the README's set-up line)."""
    assignments, argv = split_env(words)
    env = {**os.environ, "CDGRAB_DATA": str(DATA_DIR), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update({key: os.path.expandvars(value) for key, value in assignments.items()})
    expanded = [re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: env[m.group(1) or m.group(2)], word) for word in argv]
    launcher = [sys.executable] if expanded[0] == "python" else [sys.executable, "-m", "torch.distributed.run"]
    cmd = launcher + expanded[1:] + tiny_flags(argv)
    return run_python(cmd, cwd=cwd, env=env, timeout=300)


def checkout_view(folder: Path) -> Path:
    """A folder that links every file of the checkout but what the commands write."""
    folder.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in WRITTEN and not entry.name.startswith("results"):
            (folder / entry.name).symlink_to(entry)
    return folder


def test_readme_commands_are_found_and_the_rule_picks_them():
    commands = documented_commands()
    run = [" ".join(words) for words in commands if not is_skipped(words)]
    skipped = [" ".join(words) for words in commands if is_skipped(words)]
    assert any(c.startswith("pip install") for c in skipped) and any("-m pytest" in c for c in skipped)
    assert any(c.startswith("export CDGRAB_DATA=") for c in skipped)
    assert any(c.split()[:3] == ["python", "-m", "venv"] for c in skipped) and any(c.startswith(". ") for c in skipped)
    assert any("sweep-LR-HMDA.sh" in c for c in skipped) and any("reproduce-all.sh" in c for c in skipped)
    # the Quick start, in order (the smoke run, the full run, then the same run under torchrun), and one
    # command of every other benchmark and of the example
    assert run[0].split()[:2] == ["python", "main-LR-HMDA.py"] and "--max-train-examples" in run[0]
    assert run[1].split()[:2] == ["python", "main-LR-HMDA.py"] and "--max-train-examples" not in run[1]
    assert run[2].startswith("torchrun ") and "main-LR-HMDA.py" in run[2]
    for script in ("main-LSTM-Wiki2.py", "main-MLP-M4.py", "main-GPT2-Wiki103.py", "examples/ddp_lr_hmda.py"):
        assert any(script in c for c in run), script
    # every command that runs has a tiny size
    for words in commands:
        if not is_skipped(words):
            tiny_flags(split_env(words)[1])


def test_default_out_tells_a_smoke_run_from_the_full_run_but_not_the_epochs_or_the_launch():
    from engine.cli import check_args, common_parser

    parser = common_parser("toy", "toy", dict(sorter="CD-GraB", lr=0.1, B=4, node_cnt=2, epochs=3))
    defaults = vars(parser.parse_args([]))

    def out(*argv):
        args = parser.parse_args(list(argv))
        check_args(args, "toy", defaults)
        return args.out

    full = out()
    assert full == "results/toy/CD-GraB-node2-B4-lr0.1-seed0"
    assert out("--max-train-examples", "8000") == "results/toy/CD-GraB-node2-B4-lr0.1-max-train-examples8000-seed0"
    assert out("--max-eval-examples", "32") != full
    assert out("--momentum", "0.5") != full and out("--tf32") != full
    # --epochs may change on --resume (a longer run continues a shorter one): not in the name, nor where
    # the data are read from, nor how the run is launched and logged
    assert out("--epochs", "2", "--data-dir", "elsewhere", "--progress", "off", "--record-orders") == full


@pytest.mark.slow
@needs_data("hmda/raw/hmda_train_preprocessed.zip", "wikitext-2", "m4/Weekly-train.csv", "m4/Weekly-test.csv",
            "wikitext-103", "gpt2-tokenizer")
def test_every_readme_command_runs_as_written_top_to_bottom(tmp_path):
    cwd = checkout_view(tmp_path / "checkout")
    failures, done = [], set()
    for words in documented_commands():
        if is_skipped(words) or tuple(words) in done:
            continue
        if target_of(split_env(words)[1]) in READ_ONLY:
            done.add(tuple(words))
        result = run_command(words, cwd)
        if result.returncode != 0:
            failures.append(f"{shlex.join(words)}\n  exit {result.returncode}: "
                            f"{(result.stderr or result.stdout).strip().splitlines()[-1:]}")
    assert not failures, "README / docs commands that fail:\n" + "\n".join(failures)
    assert list((cwd / "results" / "LR-HMDA").iterdir())
