"""The one exception type whose message is shown to the user as a single line (no traceback), how that
line is printed once per job, and argparse with the same one-line errors."""
import argparse
import json
import os
import sys
import time

# Under torchrun every process runs the same checks, so bad input is normally seen by every rank at about
# the same time. Rank 0 alone reports it; torchrun stops the other processes as soon as rank 0 exits
# (it polls them every 0.1 s). A rank that sees an error rank 0 does not (rank 0 then waits in a
# collective) reports it itself after this many seconds.
PEER_REPORT_DELAY_SECONDS = 10.0


class UserFacingError(Exception):
    """Bad input or a failed run, explained in one line that says what to do.

    The entry scripts catch it, print ``error: <message>`` to stderr and exit with status 2
    (exit_with_error).
    """


def exit_with_error(message: str, status: int = 2):
    """Print `error: <message>` to stderr and exit with `status`; under torchrun only rank 0 prints at
    once, any other rank after PEER_REPORT_DELAY_SECONDS (if torchrun has not stopped it by then)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0:
        try:
            time.sleep(PEER_REPORT_DELAY_SECONDS)
        except KeyboardInterrupt:
            sys.exit(130)
    print(f"error: {message}", file=sys.stderr, flush=True)
    tell_launcher(f"error: {message}")
    sys.exit(status)


def tell_launcher(line: str) -> None:
    """Under torchrun, write `line` to this process's $TORCHELASTIC_ERROR_FILE, so that the launcher's
    ChildFailedError summary, which it prints after all of the processes' output, shows it as the root
    cause's "traceback" (else a link to the elastic docs). The layout is the one torch's @record writes
    (torch.distributed.elastic.multiprocessing.errors.ErrorHandler); the summary shows
    extraInfo.py_callstack. No-op outside torchrun or when the file cannot be written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    timestamp = str(int(time.time()))  # the summary's root cause is the failure with the earliest one
    try:
        with open(path, "w") as file:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": timestamp}}},
                      file)
    except OSError:
        pass  # the line is on stderr already


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad command line in one line (argparse prints the whole usage block first)."""

    def error(self, message):
        exit_with_error(f"{message}; see {self.prog} --help")  # once per torchrun job, status 2
