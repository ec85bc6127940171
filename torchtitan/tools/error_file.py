"""A failed rank's one error line, left where torchrun looks for it ($TORCHELASTIC_ERROR_FILE): the launcher shows it
when that rank's output is filtered out (run_train.sh's LOG_RANK)."""

from __future__ import annotations

import json
import os
import time

__all__ = ["leave_error_line"]


def leave_error_line(line: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
