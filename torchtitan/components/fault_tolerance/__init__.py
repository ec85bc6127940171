"""Running on a cluster: preemption (a signal stops every rank after the same step, which is saved), the hang
watchdog (a hang names its rank), the straggler check, and the fault injection their tests use. The training loop
talks to `FaultTolerance` (loop.py); docs/launching.md is the user's side."""

from torchtitan.components.fault_tolerance.faults import check_fault_ranks
from torchtitan.components.fault_tolerance.loop import FaultTolerance
from torchtitan.components.fault_tolerance.preemption import PREEMPTED_EXIT_CODE
from torchtitan.components.fault_tolerance.watchdog import HANG_EXIT_CODE, enable_flight_recorder

__all__ = ["HANG_EXIT_CODE", "PREEMPTED_EXIT_CODE", "FaultTolerance", "check_fault_ranks", "enable_flight_recorder"]
