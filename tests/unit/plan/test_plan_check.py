"""benchmarks/plan_check.json is what the plan predicts today for every kind of run measured on GPUs (regenerated
here from the committed result JSONs, so the file cannot drift from the code), and every prediction is within the
stated bounds: reserved memory 7%, tokens/s 15%."""

import json

from scripts.plan_check import RUNS, report
from torchtitan.plan.__main__ import CHECK_FILE, MEMORY_BOUND, SPEED_BOUND


def test_plan_check_json_is_regenerated_from_the_results_and_holds_the_bounds():
    regenerated = report()
    assert json.loads(CHECK_FILE.read_text()) == json.loads(json.dumps(regenerated)), (
        "benchmarks/plan_check.json is stale: run python scripts/plan_check.py"
    )
    rows = regenerated["rows"]
    assert len(rows) == len(RUNS) >= 6
    for row in rows:
        memory_error = row["memory_gib_predicted"] / row["memory_gib_measured"] - 1
        assert abs(memory_error) <= MEMORY_BOUND, (row["run"], f"memory {memory_error:+.1%}")
        if row["tokens_per_sec_measured"] is not None:
            speed_error = row["tokens_per_sec_predicted"] / row["tokens_per_sec_measured"] - 1
            assert abs(speed_error) <= SPEED_BOUND, (row["run"], f"tokens/s {speed_error:+.1%}")
    assert sum(row["tokens_per_sec_measured"] is not None for row in rows) >= 6
