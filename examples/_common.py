"""What the examples share, so that they need the library (`sorters`) and the data loaders (`data/`) only,
never the suite's engine: a one-line error exit, argparse with one-line errors, the data folder's default."""
import argparse
import os
import sys
import time

from data.common import UserFacingError  # the one error type the data loaders raise (a missing file, ...)

# Under torchrun every process runs the same checks; rank 0 alone reports, and torchrun stops the others
# when it exits. A rank that sees an error rank 0 does not reports it itself after this many seconds.
PEER_REPORT_DELAY_SECONDS = 10.0


def default_data_dir() -> str:
    """`$CDGRAB_DATA` when set, else `./datasets` (the suite's own default)."""
    return os.environ.get("CDGRAB_DATA") or "./datasets"


def exit_with_error(message: str, status: int = 2):
    """`error: <message>` on stderr, exit `status`; under torchrun rank 0 at once, another rank later."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0:
        time.sleep(PEER_REPORT_DELAY_SECONDS)
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad command line in one line (argparse prints the whole usage block first)."""

    def error(self, message):
        exit_with_error(f"{message}; see {self.prog} --help")


def load_or_exit(load, *args, **kwargs):
    """load(*args, **kwargs), or its one-line error (a missing or unreadable data set) and exit 2."""
    try:
        return load(*args, **kwargs)
    except UserFacingError as error:
        exit_with_error(str(error))


def settings_or_exit(settings_class, **fields):
    """settings_class(**fields) (sorters.CDGraBSettings), or its one-line refusal and exit 2: called before
    any data is loaded, so that bad settings print that line and nothing else."""
    try:
        return settings_class(**fields)
    except (TypeError, ValueError) as error:
        exit_with_error(str(error))
