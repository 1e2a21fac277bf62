"""Test-suite hooks: torch's thread count per test process, the needs_data marker (tests/helpers.py),
checked before a test's fixtures run, so a missing data set skips the test (or fails it under $CI)
instead of erroring in a fixture, and the order modules are handed to the test processes in."""
import os
from collections import Counter

import pytest
import torch

from tests.helpers import require_data


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_data(*paths): files or folders under $CDGRAB_DATA the test reads")
    # pytest-xdist runs one test process per core (pytest.ini): torch's own threads in each of them would
    # oversubscribe the cores, and its OpenMP workers spin while they wait, so a share of the cores each
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# The modules that take longest, longest first. pytest-xdist's loadscope hands each process a whole module
# at a time, in collection order (pytest.ini: --no-loadscope-reorder), so these start first and the short
# modules fill in at the end. xdist's own order (most tests first) started the three-test README module,
# the longest of all, last: the other process sat idle for the whole of it. A module that takes more than
# about 20 s (pytest --durations) belongs here.
LONGEST_FIRST = ("test_readme_commands.py", "test_gpu_session.py", "test_communication.py", "test_gpt2_wiki103.py",
                 "test_docs_blocks.py", "test_notebooks.py", "test_examples_standalone.py", "test_hf_trainer.py", "test_reproduction.py", "test_packaging.py",
                 "test_lr_hmda.py", "test_sweeps.py", "test_lstm_wiki2.py", "test_sketch_records.py",
                 "test_multinode.py", "test_sampler.py", "test_linear_stack.py", "test_gpu_bench.py",
                 "test_lstm_eval.py", "test_sketch.py", "test_reorderers.py", "test_device.py")


def pytest_collection_modifyitems(items):
    """The modules of LONGEST_FIRST first, in its order, then the others by number of tests (xdist's order);
    a module's own tests keep theirs."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    tests = Counter(item.path for item in items)
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -tests[item.path], str(item.path)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs_data"):
        require_data(*mark.args)
