"""The helper scripts' command lines: --help shows the script's own usage (and for the communication sweep
the defaults it really uses), bad arguments get one line and exit 2."""
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO

SCRIPTS = REPO / "scripts"
COMMANDS = {  # script: how it is started
    "download_data.sh": ["bash", str(SCRIPTS / "download_data.sh")],
    "reproduction_tables.py": [sys.executable, str(SCRIPTS / "reproduction_tables.py")],
    "mutation.py": [sys.executable, str(SCRIPTS / "mutation.py")],
    "sweep-communication.sh": ["bash", str(SCRIPTS / "sweep-communication.sh")],
}
# the sweep variables whose defaults the help states; unset, so that the script's own defaults apply
SWEEP_VARIABLES = ("STRATEGIES", "REDUCERS", "SORTERS", "SEEDS", "EPOCHS", "RESULTS", "NPROC", "DRY_RUN")


def run(script, *args, cwd, env=None):
    return subprocess.run([*COMMANDS[script], *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", COMMANDS)
def test_help_shows_the_scripts_own_usage(tmp_path, script):
    """From an empty folder, which stays empty: --help is no folder name (download_data.sh used to hand it
    to mkdir, reproduction_tables.py to read it as the results folder)."""
    result = run(script, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    first_line = result.stdout.splitlines()[0]
    assert re.match(rf"usage: (python )?scripts/{re.escape(script)}\b", first_line), result.stdout
    assert len(result.stdout.splitlines()) > 5 and not result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script,args,message", [
    ("download_data.sh", ["--data-dir"], "unknown option '--data-dir'"),
    ("download_data.sh", ["a", "b"], "one DATA_DIR at most"),
    ("reproduction_tables.py", ["--out", "x"], "unrecognized arguments: --out"),
    ("reproduction_tables.py", ["no-such-folder"], "RESULTS_DIR no-such-folder is not a folder"),
    ("mutation.py", ["--files", "engine"], "argument --files: invalid choice: 'engine'"),
])
def test_bad_arguments_get_one_line(tmp_path, script, args, message):
    result = run(script, *args, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: ") and message in line and line.endswith(" --help"), line
    assert list(tmp_path.iterdir()) == []


def test_communication_sweep_help_states_its_real_defaults(tmp_path):
    """The defaults and run folders --help names are the runs a dry run with nothing set would start."""
    env = {key: value for key, value in os.environ.items() if key not in SWEEP_VARIABLES}
    help_text = run("sweep-communication.sh", "--help", cwd=tmp_path, env=env).stdout

    def default(variable):
        return re.search(rf'^  {variable} .*\(default "?([^")]*)"?\)$', help_text, flags=re.M).group(1).split()

    template = re.search(r"Runs go to \$RESULTS/(\S+);", help_text).group(1)
    expected = []
    for strategy in default("STRATEGIES"):
        for reducer in default("REDUCERS"):
            for sorter in default("SORTERS"):
                for seed in default("SEEDS"):
                    expected.append(template.replace("<strategy>", strategy).replace("<reducer>", reducer)
                                    .replace("<sorter>", sorter).replace("<seed>", seed))
    dry = run("sweep-communication.sh", cwd=tmp_path, env={**env, "DRY_RUN": "1", "PYTHON": sys.executable})
    assert dry.returncode == 0, dry.stderr
    commands = re.findall(r"^\[sweep-MLP-M4\] run  \S+: (.*)$", dry.stdout, flags=re.M)
    (results,) = default("RESULTS")
    assert [re.search(r"--out (\S+)", command).group(1) for command in commands] == [f"{results}/{run}"
                                                                                     for run in expected]
    (epochs,) = default("EPOCHS")
    assert all(re.findall(r"--epochs (\S+)", command) == [epochs] for command in commands), commands
