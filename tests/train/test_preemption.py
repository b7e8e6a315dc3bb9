"""StopRequest on its own: the flag, the time since the request, the handlers put back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from memoria_ds.train.preemption import StopRequest


def test_a_signal_sets_the_flag_and_starts_the_clock():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequest.install()
    try:
        assert not stop.agreed() and stop.seconds() == 0.0 and stop.name == "none"
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the Python-level handler runs between bytecodes
        assert stop.agreed() and stop.name == "SIGTERM"
        first = stop.seconds()
        assert 0.0 < first < 5.0
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal changes nothing
        time.sleep(0.05)
        assert stop.name == "SIGTERM" and stop.seconds() >= first
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before


_STOP = """
import os, signal, sys, time
from memoria_ds.train import preemption
preemption.DUMP_AFTER_S = 0.5
stop = preemption.StopRequest.install()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.05)
assert stop.agreed()
def a_checkpoint_that_takes_long(seconds):
    time.sleep(seconds)
a_checkpoint_that_takes_long(float(sys.argv[1]))
stop.finished()
time.sleep(1.0)
stop.uninstall()
"""


def _stop_that_takes(seconds: float) -> str:
    proc = subprocess.run([sys.executable, "-c", _STOP, str(seconds)], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_a_slow_stop_prints_where_every_thread_waits_and_a_quick_one_prints_nothing():
    slow = _stop_that_takes(1.5)
    assert "Timeout" in slow and "a_checkpoint_that_takes_long" in slow, slow
    assert slow.count("a_checkpoint_that_takes_long") == 1  # once, not every DUMP_AFTER_S
    assert _stop_that_takes(0.0) == ""  # finished() before the timer: no dump, then or later
