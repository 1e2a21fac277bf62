"""The process around a run, for every entry script (main-*.py): parse and check the flags, claim the
run folder, set up the device and the workers, build the task, train; and turn each way a run can end
(bad input, Ctrl-C, SIGTERM, out of memory, a lost peer) into one line and its exit status.
"""
import os
import signal
import sys

import torch

from common.errors import UserFacingError, exit_with_error, tell_launcher
from engine.cli import check_args, check_resume
from engine.comm import make_communicator
from engine.device import set_tf32, setup_device
from engine.rundir import RunFinished, claim_run_folder
from engine.train import train


def run_entry_point(benchmark: str, parser, build_task) -> None:
    """Parse, check, set up workers, build the task, train; turn failures into one-line errors.

    build_task(args, device) -> Task. Exit status: 0 ok, 2 bad input / failed run, 1 lost a peer, 130
    interrupted (Ctrl-C), 143 stopped by SIGTERM.
    """
    args = parser.parse_args()
    out_given, comm, lock = args.out is not None, None, None
    # torchrun stops every process with SIGTERM when one fails or its node loses the rendezvous: say so
    # in one line rather than vanish without a word
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        # every check that needs no data comes before the process group: a bad run fails before torchrun's
        # rendezvous, and in every process alike
        check_args(args, benchmark, defaults=vars(parser.parse_args([])))
        check_resume(args, benchmark, out_given)
        lock = claim_run_folder(args, benchmark)  # one writer (rank 0); finished runs and others' files untouched
        device, backend = setup_device(args.device, args.backend)
        set_tf32(args.tf32)
        comm = make_communicator(args.node_cnt, device, backend, args.dist_timeout)
        torch.manual_seed(args.seed)
        task = build_task(args, device)
        train(task, args, comm, device)
        comm.close(finished=True)
    except RunFinished as finished:  # --resume of a finished run without a checkpoint: exit 0, nothing changed
        if int(os.environ.get("RANK", "0")) == 0:
            print(finished, file=sys.stderr)
    except UserFacingError as error:
        quiet_sigterm()  # a rank waiting in exit_with_error while rank 0 reports: torchrun's SIGTERM ends it
        exit_with_error(str(error))  # under torchrun: printed once (rank 0), every rank exits 2
    except KeyboardInterrupt:
        quiet_sigterm()
        print(f"interrupted; the last finished epoch is in {args.out or '--out'}/checkpoint.pt (continue with "
              "--resume)", file=sys.stderr)
        sys.exit(130)
    except Terminated:
        quiet_sigterm()
        print(terminated_line(args, comm), file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
    except (RuntimeError, ConnectionError) as error:
        quiet_sigterm()
        if out_of_memory(error):
            exit_with_error(f"out of memory ({str(error).strip().splitlines()[0][:200]}); make the run smaller "
                            "(--B, the model's size flags, --max-train-examples) or use a larger device")
        if comm is None or comm.world_size == 1:
            raise
        exit_lost_peer(error, args, comm)
    finally:
        quiet_sigterm()
        if comm is not None:
            comm.close()
        if lock is not None:
            lock.release()


def exit_lost_peer(error: BaseException, args, comm) -> None:
    """Exit 1 with one line: under torchrun a failed collective almost always means a peer died."""
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    line = (f"error: rank {comm.rank}: a collective failed ({first_line}); did another rank die? see its "
            f"output above. The last finished epoch is in {args.out}/checkpoint.pt (continue with --resume)")
    print(line, file=sys.stderr)
    tell_launcher(line)
    sys.exit(1)


def terminated_line(args, comm) -> str:
    """What a run stopped by SIGTERM says (no "error:" prefix: under torchrun the error is another rank's,
    reported by it, or a lost node's); torchrun named only when the run is under it."""
    rank = f"rank {comm.rank}: " if comm is not None and comm.world_size > 1 else ""
    why = (" (torchrun stops every process when one fails or a node is lost: see the output above)"
           if "TORCHELASTIC_RUN_ID" in os.environ else "")
    return (f"{rank}stopped by SIGTERM{why}; the last finished epoch is in {args.out or '--out'}/checkpoint.pt "
            "(continue with --resume)")


def out_of_memory(error: BaseException) -> bool:
    """Whether a RuntimeError is an allocation that failed (the CPU allocator's, or CUDA's)."""
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


class Terminated(Exception):
    """SIGTERM arrived (raise_terminated, run_entry_point's handler)."""


def raise_terminated(signum, frame):
    raise Terminated()


def quiet_sigterm() -> None:
    """SIGTERM's default again: once a run is on its way out (an error said, or the end), a SIGTERM ends
    it without a second line or a traceback from inside the exit path."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

