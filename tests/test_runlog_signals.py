"""engine.runlog.signals_deferred: a SIGTERM or Ctrl-C that arrives while an epoch's files are written runs
its handler after the block, once, so checkpoint.pt, orders.pt and metrics.csv describe the same epoch
(tests/test_lr_hmda.py stops a whole run by SIGTERM)."""
import os
import signal

import pytest

from engine.runlog import signals_deferred


class Stopped(Exception):
    pass


def test_a_signal_inside_the_block_runs_its_handler_after_the_block_once():
    calls, done = [], []

    def handler(signum, frame):
        calls.append(signum)
        raise Stopped()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(Stopped):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("all files written")  # reached: the handler has not run yet
        assert done == ["all files written"] and calls == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is handler  # the run's own handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_ctrl_c_inside_the_block_raises_keyboard_interrupt_after_it_and_no_signal_changes_nothing():
    # Python's own Ctrl-C handler, as a run has it: a pytest-xdist worker starts with SIGINT ignored, and
    # whether an earlier test in the same worker installed Python's handler (nbclient does) must not matter
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        done = []
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                done.append("written")
        assert done == ["written"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with signals_deferred():
            done.append("quiet")
        assert done == ["written", "quiet"]
    finally:
        signal.signal(signal.SIGINT, previous)
