#!/usr/bin/env bash
# The end-to-end GPU benchmark sets of benchmarks/README.md (deep_ep importable). Each set's ratios come from runs
# of one invocation, on one machine:
#   BENCH_OUT=benchmarks/results bash scripts/bench/e2e_suite.sh ep4      # 4 GPUs: 16B-class, the ratio matrix + no AC
#   BENCH_OUT=benchmarks/results bash scripts/bench/e2e_suite.sh ep2      # 2 GPUs: the same matrix
#   BENCH_OUT=benchmarks/results bash scripts/bench/e2e_suite.sh ep4full  # 4 GPUs: the full 27-layer 16B flavor
#   BENCH_OUT=benchmarks/results bash scripts/bench/e2e_suite.sh parity   # 4 GPUs: 50-step loss parity, debug model
set -uo pipefail
cd "$(dirname "$0")/../.."
R="python3 scripts/bench/e2e.py"
P="python3 scripts/bench/loss_parity.py"
OUT_DIR=${BENCH_OUT:-benchmarks/results}

# The 16B job (train_configs/deepseek_v3_16b.toml) with its own batch (4 x 4096 tokens per GPU), FSDP x EP over
# all GPUs, balanced routing; step 12 is profiled (rank 0's op summary goes into the JSON) and left out of the
# median. run16 uses flavor 16B_bench4 (the 16B shape cut to 8 layers), run16full the full 27-layer flavor.
run_16b() {
  local ngpu=$1 flavor=$2 name=$3; shift 3
  timeout 300 $R --name "${name}" --ngpu "$ngpu" --warmup-steps 4 --profile-step 12 -- \
    --model.flavor "$flavor" --training.steps 16 --debug.moe_force_load_balance --checkpoint.enable=false \
    --metrics.enable_tensorboard=false --parallelism.expert_parallel_degree "$ngpu" "$@" | tail -1
}
run16() { local ngpu=$1 name=$2; shift 2; run_16b "$ngpu" 16B_bench4 "16b8L_ep${ngpu}_$name" "$@"; }
run16full() { local ngpu=$1 name=$2; shift 2; run_16b "$ngpu" 16B "16b_ep${ngpu}_$name" "$@"; }

# standard vs deepep, eager vs compile, per-op SAC vs full AC: every ratio of the README from this one set
matrix() {
  local n=$1
  run16 "$n" deepep_compile_sac
  run16 "$n" standard_compile_sac --parallelism.expert_parallel_comm_backend standard
  run16 "$n" deepep_eager_sac --compile.enable=false
  run16 "$n" deepep_compile_fullac --activation_checkpoint.mode full
  run16 "$n" deepep_eager_fullac --compile.enable=false --activation_checkpoint.mode full
  run16 "$n" standard_eager_sac --parallelism.expert_parallel_comm_backend standard --compile.enable=false
}

case "${1:?usage: e2e_suite.sh ep4|ep2|ep4full|parity}" in
ep4)
  matrix 4
  # no activation checkpointing: what saving more under SAC could gain at most, and its memory
  run16 4 deepep_compile_noac --activation_checkpoint.mode none
  ;;
ep2) matrix 2 ;;
ep4full)
  run16full 4 deepep_compile_sac
  run16full 4 standard_compile_sac --parallelism.expert_parallel_comm_backend standard
  run16full 4 deepep_compile_fullac --activation_checkpoint.mode full
  ;;
parity)
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
  ;;
*) echo "unknown set $1: use ep4, ep2, ep4full or parity" >&2; exit 2 ;;
esac
