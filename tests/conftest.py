"""Test-suite hooks: torch's thread count per test process, and the needs_data marker (tests/helpers.py),
checked before a test's fixtures run, so a missing data set skips the test (or fails it under $CI)
instead of erroring in a fixture."""
import os

import pytest
import torch

from tests.helpers import require_data


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_data(*paths): files or folders under $CDGRAB_DATA the test reads")
    # pytest-xdist runs one test process per core (pytest.ini): torch's own threads in each of them would
    # oversubscribe the cores, and its OpenMP workers spin while they wait, so a share of the cores each
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs_data"):
        require_data(*mark.args)
