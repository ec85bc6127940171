"""Stop signals on one rank: recorded, agreed on at the step end after, and the process's handlers given back."""

import os
import signal

from torchtitan.components.fault_tolerance.preemption import StopSignals


def test_a_signal_is_recorded_and_stops_at_the_step_end_after_the_one_it_arrived_in():
    before = signal.getsignal(signal.SIGTERM)
    signals = StopSignals(group=None)
    signals.install()
    try:
        assert signals.agreed_signal() == 0  # end of step 1
        os.kill(os.getpid(), signal.SIGUSR1)  # during step 2: Slurm's warning
        assert signals.agreed_signal() == 0  # end of step 2: the agreement on it starts
        os.kill(os.getpid(), signal.SIGTERM)  # a later signal is recorded; the stop is already agreed on
        assert signals.agreed_signal() == signal.SIGUSR1  # end of step 3: stop
        assert signals.received == [signal.SIGUSR1, signal.SIGTERM]
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGTERM) == before
