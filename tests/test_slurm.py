"""scripts/slurm/train.sbatch rendered with fake SLURM: the srun + torchrun command it would start, read back
by torchrun's own argument parser, and its one-line refusals (no SLURM here: scontrol and srun are stubs)."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

TEMPLATE = REPO / "scripts" / "slurm" / "train.sbatch"
JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-[07,09]", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4"}


@pytest.fixture
def fake_slurm(tmp_path):
    """A PATH whose scontrol expands gpu-[07,09] and whose srun records its argv (as JSON) and exits 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && [ "$3" = "gpu-[07,09]" ] '
                                      '&& printf "gpu-07\\ngpu-09\\n" || exit 1\n')
    (bin_dir / "srun").write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                                  "open(os.environ['SRUN_LOG'], 'w').write(json.dumps(sys.argv[1:]))\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_LOG": str(tmp_path / "srun.json")}


def render(fake_slurm, *args, cwd=REPO, **env):
    """The job in `cwd` (sbatch's working directory), with no interpreter chosen (PYTHON, VIRTUAL_ENV) unless
    `env` gives one."""
    job_env = {key: value for key, value in os.environ.items()
               if not key.startswith("SLURM_") and key not in ("PYTHON", "VIRTUAL_ENV")}
    job_env.update({**JOB, **fake_slurm, **env})
    job_env = {key: value for key, value in job_env.items() if value is not None}
    return subprocess.run(["bash", str(TEMPLATE), *args], cwd=cwd, env=job_env, capture_output=True, text=True,
                          timeout=30)


def test_one_launcher_per_node_meets_at_the_first_node(fake_slurm, tmp_path):
    from torch.distributed.run import get_args_parser

    result = render(fake_slurm, "main-LSTM-Wiki2.py", "--sorter", "CD-GraB", "--node_cnt", "16", cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    argv = json.loads(open(fake_slurm["SRUN_LOG"]).read())
    assert argv[:5] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "python3", "-m", "torch.distributed.run"]
    launcher = get_args_parser().parse_args(argv[5:])  # what torchrun itself reads from the command
    assert (launcher.nnodes, launcher.nproc_per_node) == ("2", "4")
    assert (launcher.rdzv_backend, launcher.rdzv_endpoint, launcher.rdzv_id) == ("c10d", "gpu-07:29500", "4242")
    assert launcher.training_script == "main-LSTM-Wiki2.py"
    assert launcher.training_script_args == ["--sorter", "CD-GraB", "--node_cnt", "16"]


def test_settings_from_the_environment(fake_slurm):
    from torch.distributed.run import get_args_parser

    result = render(fake_slurm, "main-MLP-M4.py", NPROC_PER_NODE="2", RDZV_PORT="31000", PYTHON="/opt/venv/bin/python",
                    SLURM_GPUS_ON_NODE=None)
    assert result.returncode == 0, result.stderr
    argv = json.loads(open(fake_slurm["SRUN_LOG"]).read())
    assert argv[2] == "/opt/venv/bin/python"
    launcher = get_args_parser().parse_args(argv[5:])
    assert (launcher.nproc_per_node, launcher.rdzv_endpoint) == ("2", "gpu-07:31000")
    without_gpus = render(fake_slurm, "main-MLP-M4.py", SLURM_GPUS_ON_NODE=None)
    assert without_gpus.returncode == 0
    assert get_args_parser().parse_args(json.loads(open(fake_slurm["SRUN_LOG"]).read())[5:]).nproc_per_node == "1"


def test_the_interpreter_is_the_activated_venv_else_the_checkouts_venv_else_python3(fake_slurm, tmp_path):
    """Without PYTHON: $VIRTUAL_ENV/bin/python, else .venv/bin/python in the job's working directory (the
    checkout, where sbatch was run), else python3 from PATH; PYTHON wins over all of them."""
    def interpreter(**env):
        assert render(fake_slurm, "main-MLP-M4.py", cwd=tmp_path / "checkout", **env).returncode == 0
        return json.loads(open(fake_slurm["SRUN_LOG"]).read())[2]

    for venv in (tmp_path / "checkout" / ".venv", tmp_path / "activated"):
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").write_text("#!/bin/sh\n")
    assert interpreter() == "python3"  # neither executable yet
    (tmp_path / "checkout" / ".venv" / "bin" / "python").chmod(0o755)
    assert interpreter() == str(tmp_path / "checkout" / ".venv" / "bin" / "python")
    checkouts = str(tmp_path / "checkout" / ".venv" / "bin" / "python")
    assert interpreter(VIRTUAL_ENV=str(tmp_path / "activated")) == checkouts  # not executable there yet
    (tmp_path / "activated" / "bin" / "python").chmod(0o755)
    assert interpreter(VIRTUAL_ENV=str(tmp_path / "activated")) == str(tmp_path / "activated" / "bin" / "python")
    assert interpreter(VIRTUAL_ENV=str(tmp_path / "activated"), PYTHON="/opt/py") == "/opt/py"


@pytest.mark.parametrize("args,env,message", [
    ([], {}, "no entry script given"),
    (["main-LR-HMDA.py"], {"SLURM_JOB_NODELIST": None}, "$SLURM_JOB_NODELIST is not set: submit this file with sbatch"),
    (["main-LR-HMDA.py"], {"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE must be a positive whole number, got '0'"),
])
def test_bad_use_gets_one_line_and_exit_2(fake_slurm, args, env, message):
    result = render(fake_slurm, *args, **env)
    assert result.returncode == 2 and not os.path.exists(fake_slurm["SRUN_LOG"]), result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
