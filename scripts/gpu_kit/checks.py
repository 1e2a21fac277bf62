"""The first call's checks on a machine (--checks): the CUDA-vs-CPU LSTM check that decides cuDNN for the
LSTM runs, bench/gpu_epochs.py alone on the GPU, bench/gpu_profile.py (every lent GPU measures itself),
and the CUDA tests in the background beside the runs. A marker in --work makes later calls skip them."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from scripts.gpu_kit.base import ROOT, log
from scripts.gpu_kit.grid import CUDA_TESTS, LSTM_CHECK

def run_logged(argv, logpath: Path, timeout: float, env=None, stop=None) -> int | None:
    """Run argv with its output appended to logpath; the exit status, or None when it ran out of time
    (or the kit was asked to stop: `stop`)."""
    with open(logpath, "a") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        process = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=env)
        end = time.monotonic() + max(1.0, timeout)
        while process.poll() is None and time.monotonic() < end and not (stop and stop.asked):
            time.sleep(0.2)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            f.write(f"\n[gpu_session] stopped after {timeout:.0f} s or by a stop signal\n")
            return None
        return process.returncode


# in one process, beside the training runs: pytest.ini's addopts (-n auto, pytest-xdist) replaced, since the
# box has no pytest-xdist and its test processes would compete with the runs for the cores
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra"]


def checks_env(args) -> dict:
    return {**os.environ, "CDGRAB_DATA": str(Path(args.data_dir).resolve()), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}


def lstm_cudnn_check(args, work: Path, budget: float, stop=None) -> str:
    """'on' when the CUDA-vs-CPU LSTM check passes with cuDNN (or is skipped: no GPU), else 'off'."""
    status = run_logged([*PYTEST, *LSTM_CHECK], work / "tests.log", budget, checks_env(args), stop)
    return "off" if status not in (0, 5, None) else "on"  # 5: nothing collected; None: out of time, undecided


def run_bench(args, work: Path, budget: float, stop=None) -> int | None:
    argv = [sys.executable, str(ROOT / "bench" / "gpu_epochs.py"), "--data-dir", args.data_dir,
            "--json", str(work / "gpu-epochs.json")]
    if args.tiny:
        argv += ["--device", "cpu", "--benchmarks", "LR-HMDA", "--steps", "2"]
    return run_logged(argv, work / "bench.log", budget, checks_env(args), stop)


def run_profile(args, work: Path, budget: float, stop=None) -> int | None:
    """bench/gpu_profile.py: where a step's time goes on this machine, per benchmark and sorter."""
    argv = [sys.executable, str(ROOT / "bench" / "gpu_profile.py"), "--data-dir", args.data_dir,
            "--out", str(work / "gpu-profile.txt")]
    if args.tiny:  # the CPU's activity, on tiny slices
        argv += ["--device", "cpu", "--benchmarks", "LR-HMDA", "--steps", "2"]
    return run_logged(argv, work / "profile.log", budget, checks_env(args), stop)


def start_tests(args, work: Path):
    tests = args.tests if args.tests is not None else CUDA_TESTS
    if not tests:
        return None
    f = open(work / "tests.log", "a")
    argv = [*PYTEST, "-rfEs", *tests]
    f.write(f"$ {' '.join(argv)}\n")
    f.flush()
    process = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                               env=checks_env(args))
    f.close()
    return process


def run_checks(args, work: Path, stop):
    """The first call's checks on a machine (see --checks): (what they found, the CUDA tests' process)."""
    marker = work / "checks.json"
    if args.checks == "none":
        return {"lstm_cudnn": "on", "skipped": True}, None
    if marker.exists():
        checks = json.loads(marker.read_text())
        log(f"checks done on this machine earlier: {checks}")
        return checks, None
    if args.checks == "tests":  # the CUDA tests beside the runs; no LSTM check (cuDNN on), no bench
        checks = {"lstm_cudnn": "on", "bench": "skipped"}
    else:
        cudnn = lstm_cudnn_check(args, work, min(120.0, 0.2 * args.deadline), stop)
        log(f"LSTM CUDA-vs-CPU check with cuDNN: {'passed' if cudnn == 'on' else 'FAILED: the LSTM runs use --cudnn off'}")
        status = run_bench(args, work, min(args.bench_seconds, 0.4 * args.deadline), stop)
        log(f"bench/gpu_epochs.py: {'done' if status == 0 else 'exit ' + str(status)}")
        checks = {"lstm_cudnn": cudnn, "bench_exit": status}
    # every lent GPU measures itself (the profile is what the CPU work between GPUs acts on), --checks
    # tests included: a minute at most before the runs
    profiled = run_profile(args, work, min(args.profile_seconds, 0.2 * args.deadline), stop)
    log(f"bench/gpu_profile.py: {'done' if profiled == 0 else 'exit ' + str(profiled)}")
    checks["profile_exit"] = profiled
    marker.write_text(json.dumps(checks))
    return checks, (None if stop.asked else start_tests(args, work))


def wait_tests(tests, work: Path, budget: float):
    """The CUDA tests' exit status, after at most `budget` seconds (then they are stopped: None)."""
    try:
        tests.wait(budget)
    except subprocess.TimeoutExpired:
        os.killpg(tests.pid, signal.SIGKILL)
        tests.wait()
        with open(work / "tests.log", "a") as f:
            f.write("\n[gpu_session] the CUDA tests ran out of time\n")
    return tests.returncode
