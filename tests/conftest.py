"""Test-suite hooks: the needs_data marker (tests/helpers.py) is checked before a test's fixtures run,
so a missing data set skips the test (or fails it under $CI) instead of erroring in a fixture."""
import pytest

from tests.helpers import require_data


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_data(*paths): files or folders under $CDGRAB_DATA the test reads")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs_data"):
        require_data(*mark.args)
