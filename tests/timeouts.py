"""How long a test waits for a process, scaled to how busy this machine is.

Every wait on a process (a trainer, a launcher, gloo ranks) takes `generous_timeout(seconds)`, where `seconds`
is several times what the step takes on an idle 2-core machine, times how overloaded this one is when the wait
starts: its 1-minute load average per usable core, at least 1. A slow pass on a loaded CI host stays a pass (the
suite went red once at load 7.6 on 2 cores, a 56 s run hitting a fixed 120 s limit), and a hang still fails, after
a bound that stays finite.
"""

import os


def machine_slowdown() -> float:
    """How many runnable processes share each core this process may use (1 on an idle machine)."""
    return max(1.0, os.getloadavg()[0] / len(os.sched_getaffinity(0)))


def generous_timeout(seconds: float) -> float:
    """`seconds` (enough on an idle 2-core machine, with margin) stretched by `machine_slowdown()`."""
    return seconds * machine_slowdown()
