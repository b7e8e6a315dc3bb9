"""StopRequest on its own: the flag, the time since the request, the handlers put back."""

from __future__ import annotations

import os
import signal
import time

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
