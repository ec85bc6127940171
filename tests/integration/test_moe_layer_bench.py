"""`scripts/bench/moe_layer.py` runs on CPU ranks (gloo) and writes its result; its times mean nothing there, only
the lead's GPU runs measure."""

import json
import os
import subprocess
import sys

from tests.integration.conftest import REPO_ROOT
from tests.timeouts import generous_timeout


def test_moe_layer_bench_writes_its_times_on_2_cpu_ranks(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "scripts/bench/moe_layer.py", "--layer", "tiny", "--backend", "deepep", "--tokens", "24", "--routing", "zipf",
        "--warmup", "0", "--iters", "1",
    ]  # fmt: skip
    env = {**os.environ, "BENCH_OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=generous_timeout(300)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("moe_layer_tiny_deepep_eager_ep2_t24_zipf1.json")
    result = json.loads(path.read_text())
    assert result["fwd_ms"] > 0 and result["fwd_bwd_ms"] > 0, result
    assert result["ep"] == 2 and result["tokens_per_rank"] == 24
    assert "fwd+bwd" in proc.stdout
