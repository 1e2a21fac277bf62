#!/usr/bin/env python
"""One lent GPU session's device call, whole: CUDA checks, then the GPU reproduction queue, every run
stopped cleanly before a deadline and packed for the trip back; and the step here that unpacks it.

On the GPU machine (the body of one call; `datasets/` carried, see docs/gpus.md):

    python scripts/gpu_session.py --deadline 540 --out "$OUT"

Here, on what came back:

    python scripts/gpu_session.py --unpack /path/to/returned/files      # -> reproduction/, bench/results/

What a call does, in order:
1. Once per machine (gpu_kit/checks.py; a marker in --work): the CUDA-vs-CPU LSTM check (if cuDNN fails
   it, the LSTM runs pass --cudnn off, recorded in config.json), bench/gpu_epochs.py alone on the GPU,
   then bench/gpu_profile.py (a torch.profiler summary per benchmark and sorter), then the CUDA tests in
   the background while the runs train; --checks tests keeps the profile and the tests, --checks none
   none of them.
2. The queue (gpu_kit/grid.py, most valuable first), planned from measured epoch times (gpu_kit/plan.py:
   the shipped sessions', else the bench's, else a conservative fallback): a run starts only when it can
   finish before the stop, or, if its checkpoint can travel (LSTM), when one epoch can end. Each run
   continues from its checkpoint in --work (a second call on the same machine goes on where the first
   stopped), else from the packed checkpoint an earlier session left in
   reproduction/<benchmark>/<run>/checkpoint.pt.gz, else starts. --parallel runs share the GPU.
3. Before the deadline (gpu_kit/run.py) each run is stopped at an epoch end: a run whose current epoch
   cannot end in time (judged by its last epoch's length) is stopped at once, the others when their epoch
   ends or at the last moment; a run still alive --grace seconds after its stop signal is killed, and
   the kit goes on. SIGTERM to the kit stops the runs the same way, packs and exits.
4. Packing (gpu_kit/pack.py), under --out, at every epoch end (at most every --pack-every seconds) and at
   the end, so a call cut at its limit returns every finished epoch: at most 8 files of at most 16 MiB,
   runs.tar.gz (every run's config.json, metrics.csv and log, the bench's log, the profile, and
   session.json: what ran, on which device, the code tree hash, epoch times), tests.log,
   gpu-epochs.json, and one checkpoint per unfinished run whose checkpoint can travel, most valuable
   first, as long as they fit (ckpt-<benchmark>--<run>.pt.gz; CD-GraB's running sum, which a new epoch
   resets, zeroed so that it compresses away); gzipped once per epoch, never for a state it drops.
5. Here, --unpack (gpu_kit/unpack.py) replaces a shipped checkpoint only by a newer one of the same run,
   removes it only when the run finished, never changes a finished shipped run (unless
   --replace-finished), keeps the longer record where neither side has a checkpoint, and keeps every
   run's record and log as it came back in reproduction/gpu-sessions/<started>/runs.tar.gz (packed: the
   analysis never meets a second copy of a run).

--device cpu --tiny runs the same path on tiny slices (the dry run in tests/test_gpu_session.py). This file
is the command line; scripts/gpu_kit/ holds the steps, one module each (gpu_kit/session.py: a call, whole).
"""
import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the kit (scripts/gpu_kit) and the engine it reads, from any working folder

from scripts.gpu_kit.data import pack_data  # noqa: E402
from scripts.gpu_kit.grid import CUDA_TESTS, TINY_EPOCHS, select_queue  # noqa: E402
from scripts.gpu_kit.base import fail  # noqa: E402
from scripts.gpu_kit.session import session  # noqa: E402
from scripts.gpu_kit.unpack import unpack  # noqa: E402


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_call_flags(parser)
    add_here_flags(parser)
    return parser


def add_call_flags(parser) -> None:
    """The flags of a device call on the GPU machine (and --pack-data, which makes its data archive here)."""
    parser.add_argument("--deadline", type=float, default=540,
                        help="seconds from start by which everything, packing included, is done (default 540)")
    parser.add_argument("--out", help="where the packed files go (the device call's $OUT)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default cuda")
    parser.add_argument("--tiny", action="store_true", help=f"tiny slices, {TINY_EPOCHS} epochs (the dry run)")
    parser.add_argument("--epochs", type=int, help="override every run's epoch count")
    parser.add_argument("--data-dir", default=os.environ.get("CDGRAB_DATA", "datasets"),
                        help="data folder, relative to the repository as it travels (default $CDGRAB_DATA, "
                             "else datasets)")
    parser.add_argument("--data-archive", metavar="TAR_GZ",
                        help="on the machine: unpack this carried archive (--pack-data) into --data-dir first")
    parser.add_argument("--pack-data", metavar="DATA",
                        help="here: pack DATA's data sets into gpu-data/datasets.tar.gz to carry, and exit")
    parser.add_argument("--work", default="/tmp/cdgrab-gpu-session",
                        help="this machine's run directories and check marker (default /tmp/cdgrab-gpu-session)")
    parser.add_argument("--shipped", help="where earlier sessions' runs and packed checkpoints wait (default "
                                           "reproduction/; with --tiny none)")
    parser.add_argument("--parallel", type=int, default=4,
                        help="runs side by side on the GPU (default 4: GPT-2 slowed 4x beside five others)")
    parser.add_argument("--only", nargs="+", metavar="BENCHMARK[/SORTER[/SEED]]",
                        help="run only these queue entries, e.g. GPT2-Wiki103, LSTM-Wiki2/CD-GraB (every "
                             "seed) or LSTM-Wiki2/CD-GraB/0; the queue's order stays")
    parser.add_argument("--tests", nargs="*", help=f"test files for the first call (default: {' '.join(CUDA_TESTS)})")
    parser.add_argument("--checks", choices=("all", "tests", "none"), default="all",
                        help="what the first call on a machine checks: all (the LSTM cuDNN check and the bench "
                             "and the profile before the runs, the CUDA tests beside them; the default), tests (the "
                             "profile, then the CUDA tests beside the runs; cuDNN on), none (straight to the queue; "
                             "cuDNN on)")
    parser.add_argument("--bench-seconds", type=float, default=150, help="time limit of the bench (default 150)")
    parser.add_argument("--pack-seconds", type=float, default=40,
                        help="seconds kept at the end for stopping and packing (default 40)")
    parser.add_argument("--grace", type=float, default=20,
                        help="seconds a run may take to stop after its stop signal before it is killed (default 20)")
    parser.add_argument("--pack-every", type=float, default=30,
                        help="$OUT is packed again after an epoch end, at most this often (seconds, default 30)")
    parser.add_argument("--profile-seconds", type=float, default=60,
                        help="time limit of the first call's profile, bench/gpu_profile.py, run by --checks all "
                             "and tests (default 60)")
    parser.add_argument("--min-start-seconds", type=float, default=60,
                        help="no run starts with less time than this left (default 60)")
    parser.add_argument("--progress-every", type=float, default=60, help="seconds between progress lines")
    parser.add_argument("--poll", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--stop-after-epochs", type=int, default=0,
                        help="stop each run cleanly after this many epochs in this call (the dry run's "
                             "deterministic stop; default 0: only the deadline)")


def add_here_flags(parser) -> None:
    """The flags of --unpack, here, on the files a device call brought back."""
    parser.add_argument("--unpack", metavar="DIR", help="here: unpack the files a device call brought back")
    parser.add_argument("--replace-finished", action="store_true",
                        help="with --unpack: let a run that came back replace a finished shipped run (never otherwise)")
    parser.add_argument("--into", default=str(ROOT / "reproduction"), help="with --unpack: runs go here")
    parser.add_argument("--bench-json", default=str(ROOT / "bench" / "results" / "gpu-epochs.json"),
                        help="with --unpack: where gpu-epochs.json goes")
    parser.add_argument("--sessions", default=str(ROOT / "reproduction" / "gpu-sessions"),
                        help="with --unpack: where each session's session.json and tests.log go")


def main():
    args = make_parser().parse_args()
    if args.pack_data:
        pack_data(Path(args.pack_data), ROOT / "gpu-data" / "datasets.tar.gz")
        return
    if args.unpack:
        unpack(Path(args.unpack), Path(args.into), Path(args.bench_json), Path(args.sessions), args.replace_finished)
        return
    if not args.out:
        fail("pass --out DIR (on the device machine: --out \"$OUT\")")
    if args.parallel < 1 or args.deadline <= args.pack_seconds:
        fail("--parallel must be >= 1 and --deadline larger than --pack-seconds")
    session(args, select_queue(args.only))  # a typo in --only is refused before anything is unpacked


if __name__ == "__main__":
    main()
