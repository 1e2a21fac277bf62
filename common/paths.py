"""Where the data sets live: one lookup for the entry scripts, the benches and the tests' defaults."""
import os


def default_data_dir() -> str:
    """`$CDGRAB_DATA` when set, else `./datasets`."""
    return os.environ.get("CDGRAB_DATA") or "./datasets"
