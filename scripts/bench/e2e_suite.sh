#!/usr/bin/env bash
# The end-to-end GPU benchmark set of benchmarks/README.md, run in one go on a 4-GPU machine (deep_ep importable):
# 50-step loss parity standard vs deepep (debug model), and the 16B-class runs whose ratios are reported.
#   BENCH_OUT=benchmarks/results bash scripts/bench/e2e_suite.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
R="python3 scripts/bench/e2e.py"
P="python3 scripts/bench/loss_parity.py"
OUT_DIR=${BENCH_OUT:-benchmarks/results}

D=(--config ./train_configs/deepseek_v3_debugmodel.toml --warmup-steps 3 -- --training.steps 50
   --parallelism.expert_parallel_degree 4 --training.mixed_precision_param bfloat16)
for b in standard deepep; do
  timeout 120 $R --name "dbg50_ep4_${b}_sac" --ngpu 4 "${D[@]}" --activation_checkpoint.mode selective \
    --parallelism.expert_parallel_comm_backend "$b" | tail -1
done
$P --name dbg50_ep4_sac "$OUT_DIR/e2e_dbg50_ep4_standard_sac.json" "$OUT_DIR/e2e_dbg50_ep4_deepep_sac.json"
for b in standard deepep; do
  timeout 150 $R --name "dbg50_ep4_${b}_compile_fullac" --ngpu 4 "${D[@]}" --compile.enable \
    --activation_checkpoint.mode full --parallelism.expert_parallel_comm_backend "$b" | tail -1
done
$P --name dbg50_ep4_compile_fullac "$OUT_DIR/e2e_dbg50_ep4_standard_compile_fullac.json" \
  "$OUT_DIR/e2e_dbg50_ep4_deepep_compile_fullac.json"

# 16B shape, 8 layers (flavor 16B_bench4), FSDP x EP=4, 4096 tokens per GPU, balanced routing.
B=(--warmup-steps 4 -- --model.flavor 16B_bench4 --training.steps 12 --training.local_batch_size 1
   --training.seq_len 4096 --debug.moe_force_load_balance --checkpoint.enable=false
   --metrics.enable_tensorboard=false --parallelism.expert_parallel_degree 4)
run16() { local name=$1; shift; timeout 150 $R --name "16b8L_ep4_$name" --ngpu 4 "${B[@]}" "$@" | tail -1; }
run16 standard_eager_sac --parallelism.expert_parallel_comm_backend standard --compile.enable=false
run16 deepep_eager_sac --compile.enable=false
run16 deepep_eager_fullac --compile.enable=false --activation_checkpoint.mode full
run16 deepep_compile_fullac --activation_checkpoint.mode full
run16 standard_compile_fullac --parallelism.expert_parallel_comm_backend standard --activation_checkpoint.mode full
