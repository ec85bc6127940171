#!/usr/bin/env bash
# The end-to-end GPU benchmark sets (deep_ep importable; current figures in benchmarks/RESULTS.md, history in
# benchmarks/NOTES.md). Each set's ratios come from runs of one invocation, on one machine. Routing is the router's
# own (natural) unless a run's name ends in _balanced (forced round-robin, --debug.moe_force_load_balance).
#   BENCH_OUT=benchmarks/results bash scripts/bench/e2e_suite.sh ep2 [deepep|standard]  # 2 GPUs: the natural matrix
#   BENCH_OUT=benchmarks/results bash scripts/bench/e2e_suite.sh ep4 [deepep|standard]  # 4 GPUs: the same
#   BENCH_OUT=benchmarks/results bash scripts/bench/e2e_suite.sh balanced2|balanced4    # forced-balance references
#   BENCH_OUT=benchmarks/results bash scripts/bench/e2e_suite.sh ep4full                # the full 27-layer 16B flavor
#   BENCH_OUT=benchmarks/results bash scripts/bench/e2e_suite.sh scaling N  # 1 GPU vs FSDP x EP over N, profiled
#   BENCH_OUT=benchmarks/results bash scripts/bench/e2e_suite.sh one N NAME [trainer args]  # one 16B_bench4 run
#   BENCH_OUT=benchmarks/results bash scripts/bench/e2e_suite.sh parity                 # 4 GPUs: 50-step loss parity
#   BENCH_OUT=benchmarks/results bash scripts/bench/e2e_suite.sh layers2|layers4        # MoE layer: balanced vs Zipf
# The matrix takes an optional backend so it can be split over two calls of one held machine (10-minute limit).
set -uo pipefail
cd "$(dirname "$0")/../.."
R="python3 scripts/bench/e2e.py"
P="python3 scripts/bench/loss_parity.py"
OUT_DIR=${BENCH_OUT:-benchmarks/results}

# The 16B job (train_configs/deepseek_v3_16b.toml) with its own batch (4 x 4096 tokens per GPU), FSDP x EP over
# all GPUs; 14 steps, the first 4 dropped as warm-up. PROFILE_STEP=N records step N (rank 0's op summary goes into
# the JSON; steps N-3..N leave the median). run16 uses flavor 16B_bench4 (the 16B shape cut to 8 layers),
# run16full the full 27-layer flavor.
run_16b() {
  local ngpu=$1 flavor=$2 name=$3; shift 3
  local profile=()
  [[ -n "${PROFILE_STEP:-}" ]] && profile=(--profile-step "$PROFILE_STEP")
  timeout 300 $R --name "${name}" --ngpu "$ngpu" --warmup-steps 4 "${profile[@]}" -- \
    --model.flavor "$flavor" --training.steps 14 --checkpoint.enable=false \
    --metrics.enable_tensorboard=false --parallelism.expert_parallel_degree "$ngpu" "$@"
}
run16() { local ngpu=$1 name=$2; shift 2; run_16b "$ngpu" 16B_bench4 "16b8L_ep${ngpu}_$name" "$@"; }
run16full() { local ngpu=$1 name=$2; shift 2; run_16b "$ngpu" 16B "16b_ep${ngpu}_$name" "$@"; }

# backend x (compile, eager) x (per-op SAC, full AC, none), natural routing
matrix() {
  local n=$1 backends=${2:-"deepep standard"}
  local -A compile=([compile]="--compile.enable" [eager]="--compile.enable=false")
  local -A ac=([sac]="--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op"
               [fullac]="--activation_checkpoint.mode full" [noac]="--activation_checkpoint.mode none")
  for b in $backends; do
    for c in compile eager; do
      for a in sac fullac noac; do
        # shellcheck disable=SC2086
        run16 "$n" "${b}_${c}_${a}" --parallelism.expert_parallel_comm_backend "$b" ${compile[$c]} ${ac[$a]}
      done
    done
  done
}

balanced() {
  local n=$1
  run16 "$n" deepep_compile_sac_balanced --debug.moe_force_load_balance
  run16 "$n" standard_compile_sac_balanced --debug.moe_force_load_balance \
    --parallelism.expert_parallel_comm_backend standard
}

layers() {
  local n=$1
  for layer in 16b 671b; do
    for routing in balanced zipf; do
      timeout 240 torchrun --nproc-per-node "$n" scripts/bench/moe_layer.py --layer "$layer" --backend deepep \
        --tokens 8192 --compile --routing "$routing"
    done
  done
}

# Does every GPU keep one GPU's speed? The same job on 1 GPU (EP=1) and FSDP x EP over n GPUs: deepep, standard
# (both with every rank's profiled step, rank_profile.py), FP8 experts + FP8 dispatch.
scaling() {
  local n=$1
  PROFILE_STEP=12 run16 1 compile_sac
  PROFILE_STEP=12 run16 "$n" deepep_compile_sac
  PROFILE_STEP=12 run16 "$n" standard_compile_sac --parallelism.expert_parallel_comm_backend standard
  run16 "$n" deepep_compile_sac_fp8 --quantize.float8_experts --deepep.float8_dispatch
}

case "${1:?usage: e2e_suite.sh ep2|ep4 [backend] | balanced2|balanced4 | ep4full | parity | layers2|layers4 | scaling N | one N NAME}" in
ep2) matrix 2 "${2:-}" ;;
ep4) matrix 4 "${2:-}" ;;
balanced2) balanced 2 ;;
balanced4) balanced 4 ;;
layers2) layers 2 ;;
layers4) layers 4 ;;
scaling) scaling "${2:?scaling takes the number of GPUs}" ;;
one) run16 "${2:?one N NAME [trainer args]}" "${3:?one N NAME [trainer args]}" "${@:4}" ;;
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
*) echo "unknown set $1: see the usage at the top of this script" >&2; exit 2 ;;
esac
