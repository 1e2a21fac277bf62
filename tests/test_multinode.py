"""Two torchrun launchers on this host stand for two nodes (`--nnodes 2 --nproc-per-node 2`, a c10d
rendezvous on 127.0.0.1, gloo): a benchmark and the own-loop sampler give the orders and losses of one
process with 4 workers; the run directory and the start line come from global rank 0 alone; a node that
dies stops the other within a minute, and the run resumes from its last checkpoint in one process."""
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import DATA_DIR, REPO, assert_runs_agree, check_ok, needs_data, read_metrics, run_python, run_script

pytestmark = [needs_data("hmda/raw/hmda_train_preprocessed.zip"), pytest.mark.slow]
SCRIPT = "main-LR-HMDA.py"
QUICK = ["--max-train-examples", "800", "--max-eval-examples", "400", "--record-orders", "--progress", "off"]
COLUMNS = ("train_loss", "test_loss", "train_acc", "test_acc")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(port: int, *script_and_args) -> list:
    """One node's torchrun command: 2 of the job's 4 processes, meeting the other node at 127.0.0.1:port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"job{port}",
            *map(str, script_and_args)]


def two_nodes(*script_and_args, env=None, timeout=240) -> list:
    """Both nodes' launchers at once; their CompletedProcesses."""
    env = {**os.environ, "CDGRAB_DATA": str(DATA_DIR), "OMP_NUM_THREADS": "1", **(env or {})}
    command = launcher(free_port(), *script_and_args)
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda _: run_python(command, env=env, timeout=timeout), range(2)))


def test_two_nodes_equal_one_process_and_only_global_rank_0_writes(tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    check_ok(run_script(SCRIPT, "--epochs", "2", "--out", single, *QUICK))
    nodes = two_nodes(SCRIPT, "--epochs", "2", "--out", multi, *QUICK)
    for node in nodes:
        check_ok(node)
    assert_runs_agree(single, multi, COLUMNS)
    config = (multi / "config.json").read_text()
    assert '"world_size": 4' in config and '"workers_per_process": 1' in config
    # the writer is global rank 0, not each node's local rank 0: one start line and one end line in all
    output = "".join(node.stdout + node.stderr for node in nodes)
    assert output.count(f"new run in {multi}") == 1 and output.count(f"done: {multi}") == 1, output


def test_the_own_loop_sampler_on_two_nodes_equals_one_process(tmp_path):
    example = REPO / "examples" / "ddp_lr_hmda.py"
    common = ["--data-dir", DATA_DIR, "--epochs", "2", "--max-train-examples", "400", "--sorter", "CD-GraB"]
    check_ok(run_python([sys.executable, example, *common, "--replicas", "4", "--save-orders", tmp_path / "one.pt"]))
    for node in two_nodes(example, *common, "--save-orders", tmp_path / "two.pt"):
        check_ok(node)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert len(one["orders"]) == len(two["orders"]) == 2 and one["orders"][0].shape == (4, 100)
    assert all(torch.equal(a, b) for a, b in zip(one["orders"], two["orders"]))
    for column in ("train_loss", "test_loss"):
        assert two[column] == pytest.approx(one[column], rel=1e-5)


def descendants(pid: int) -> list:
    """pid's child processes, theirs, and so on (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass  # a process that ended meanwhile
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def kill_node(launcher: subprocess.Popen) -> None:
    """SIGKILL a node: its launcher and every process under it (torchrun starts each worker in a session
    of its own, so the launcher's process group does not hold them)."""
    for pid in [launcher.pid, *descendants(launcher.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_dead_node_stops_the_other_and_the_run_resumes_in_one_process(tmp_path):
    """Node B (its launcher and both its processes) is killed after epoch 1's checkpoint: node A exits
    within a minute, its processes saying in one line that a peer died; --resume then finishes the run in
    one process (4 workers), equal to a run that was never interrupted."""
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    args = ["--epochs", "3", *QUICK, "--max-train-examples", "8000"]  # epochs of a few seconds: B dies mid-run
    check_ok(run_script(SCRIPT, *args, "--out", straight))
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHON_EXEC", "CDGRAB_SCRIPT_SERVER")}
    env.update(CDGRAB_DATA=str(DATA_DIR), OMP_NUM_THREADS="1")
    command = launcher(free_port(), SCRIPT, *args, "--out", crashed)
    # real processes (no script server), so that node B's launcher and workers are all its descendants
    nodes = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 180
        while not (crashed / "checkpoint.pt").exists():
            assert time.monotonic() < deadline and all(node.poll() is None for node in nodes), "epoch 1 never ended"
            time.sleep(0.05)
        kill_node(nodes[1])
        killed = time.monotonic()
        output, _ = nodes[0].communicate(timeout=60)
        assert time.monotonic() - killed < 60 and nodes[0].returncode != 0
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_node(node)
                node.wait()
    # each of node A's processes says in one line why it stopped: its collective failed (a peer died), or
    # its launcher, which lost the rendezvous when node B hosted it, stopped it with SIGTERM
    said = [line for line in output.splitlines() if line.startswith("error: ") or "stopped by SIGTERM" in line]
    assert len(said) == 2, output
    assert all("did another rank die?" in line or line.startswith("rank ") for line in said), output
    assert [row["epoch"] for row in read_metrics(crashed)] in ([1], [1, 2])  # killed before the run ended
    check_ok(run_script(SCRIPT, *args, "--out", crashed, "--resume"))
    assert_runs_agree(straight, crashed, COLUMNS)


RANK_PROBE = '''
import json, os, sys, time
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
from engine.comm import node_leader_first
from engine.device import setup_device

# pretend every node has 4 GPUs: which one would this process take? (setup_device reads torchrun's env)
torch.cuda.is_available, torch.cuda.device_count, torch.cuda.set_device = (lambda: True), (lambda: 4), (lambda d: None)
device, backend = setup_device("cuda", None)
dist.init_process_group("gloo")
local_rank = int(os.environ["LOCAL_RANK"])
with node_leader_first():  # the leader of each node builds, e.g., a token cache; the others read it
    entered = time.time()
    time.sleep(2.0 if local_rank == 0 else 0.0)  # long beside the spread of the processes' start after init
    left = time.time()
record = dict(rank=dist.get_rank(), local_rank=local_rank, node=int(os.environ["GROUP_RANK"]), device=str(device),
              backend=backend, entered=entered, left=left)
with open(os.path.join(sys.argv[1], f"rank{{dist.get_rank()}}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
'''


def test_each_node_picks_devices_and_its_leader_by_local_rank(tmp_path):
    """2 x 2 (4 GPUs a node, pretended): global ranks 2 and 3 take GPUs 0 and 1 of their node (not 2 and 3), and node_leader_first lets
    each node's local rank 0 in first, both leaders at once, the others after them."""
    import json

    probe = tmp_path / "probe.py"
    probe.write_text(RANK_PROBE.format(repo=str(REPO)))
    for node in two_nodes(probe, tmp_path):
        check_ok(node)
    records = {r["rank"]: r for r in (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(4))}
    assert sorted((r["node"], r["local_rank"]) for r in records.values()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["device"] == f"cuda:{r['local_rank']}" and r["backend"] == "nccl" for r in records.values())
    leaders = [r for r in records.values() if r["local_rank"] == 0]
    others = [r for r in records.values() if r["local_rank"] != 0]
    assert leaders[0]["entered"] < leaders[1]["left"] and leaders[1]["entered"] < leaders[0]["left"]  # side by side
    assert min(r["entered"] for r in others) >= max(r["left"] for r in leaders)
