"""What a number from the config becomes where the trainer uses it: every float option is computed in float32 (the
optimizer's step, the lr schedule's factors, loss weights, the clipping norm, capacity factors) and every int option
is an int64 (steps, sizes and counts held in tensors). Python's float and int hold values those dtypes do not: 1e45 is
inf in float32, 1e-50 is 0 and 0.9999999999 is 1.0. `limit_problem` says so for one value, `as_used` gives the value
the dtype makes of it (so a range check can run on that too); `manager.validate` applies both to every field.
"""

import math
import struct
from typing import Any

FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINIEST = 2.0**-149  # the smallest nonzero float32 (subnormal)
INT64_MAX = 2**63 - 1


def as_used(value: Any) -> Any:
    """A float `value` rounded to float32 (inf past its range); anything else as is."""
    if not isinstance(value, float):
        return value
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # struct refuses a finite value float32 rounds to inf
        return math.copysign(math.inf, value)


def limit_problem(value: Any) -> str | None:
    """Why the dtype that uses `value` cannot hold it (said after "<key>=<value> "), or None. inf and nan are left to
    the range checks, which know whether a field takes them."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        return f"does not fit in int64, the dtype the trainer keeps it in (at most {INT64_MAX})"
    if not isinstance(value, float) or not math.isfinite(value):
        return None
    stored = as_used(value)
    if math.isinf(stored):
        return f"is inf in float32, the dtype the trainer computes it in (largest finite value {FLOAT32_MAX:.4g})"
    if stored == 0 and value != 0:
        return f"is 0 in float32, the dtype the trainer computes it in (smallest nonzero value {FLOAT32_TINIEST:.3g})"
    return None
