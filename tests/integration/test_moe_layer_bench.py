"""`scripts/bench/moe_layer.py` runs on CPU ranks (gloo) and reports the EP overlap's parts; its times mean nothing
there, only the lead's GPU runs measure."""

import json
import os
import subprocess
import sys

from tests.integration.conftest import REPO_ROOT


def test_moe_layer_bench_reports_the_overlap_parts_with_a_comm_slowdown_on_2_cpu_ranks(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "scripts/bench/moe_layer.py", "--layer", "tiny", "--backend", "deepep", "--tokens", "24", "--routing", "zipf",
        "--comm-slowdown", "2", "--warmup", "0", "--iters", "1",
    ]  # fmt: skip
    env = {**os.environ, "BENCH_OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("moe_layer_tiny_deepep_eager_ep2_t24_zipf1_slow2.json")
    result = json.loads(path.read_text())
    assert result["comm_slowdown"] == 2
    parts = ("compute_fwd_bwd_ms", "exchange_fwd_bwd_ms", "overlap_off_fwd_bwd_ms", "overlap_on_fwd_bwd_ms")
    assert all(result[part] > 0 for part in parts), result
    assert result["fwd_bwd_ms"] == result["overlap_off_fwd_bwd_ms"]
    on, off = result["overlap_on_fwd_bwd_ms"], result["overlap_off_fwd_bwd_ms"]
    assert result["hidden_fraction"] == (off - on) / result["exchange_fwd_bwd_ms"]
    assert "hidden" in proc.stdout and "exchange" in proc.stdout
