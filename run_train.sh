#!/usr/bin/env bash
# Launch training: CONFIG_FILE=./train_configs/<job>.toml NGPU=N ./run_train.sh [--section.field value ...]
#
# NGPU     processes per node (default: the number of GPUs, or 1 on a CPU-only machine)
# NNODES   nodes (default 1); with NNODES > 1 set RDZV_ENDPOINT=host:port (same on every node) and RDZV_ID
# LOG_RANK local ranks whose output is shown (default 0; "0,1" or "all")
# PYTORCH_ALLOC_CONF default expandable_segments:True (unless it or PYTORCH_CUDA_ALLOC_CONF is set)
# TORCHRUN_ARGS extra torchrun flags, e.g. "--max-restarts 3" to resume from the latest checkpoint after a crash
set -euo pipefail

CONFIG_FILE=${CONFIG_FILE:-"./train_configs/deepseek_v3_debugmodel.toml"}
PYTHON=${PYTHON:-python}

for arg in "$@"; do
  if [[ "$arg" == "--help" || "$arg" == "-h" ]]; then
    # help with this job's values, printed by the config parser before anything imports torch
    exec "$PYTHON" -m torchtitan.preflight --world-size 1 --job.config_file "$CONFIG_FILE" "$@"
  fi
done

if [[ -d "$CONFIG_FILE" ]]; then
  echo "error: CONFIG_FILE '$CONFIG_FILE' is a folder; pick a .toml file, e.g. from ./train_configs/" >&2
  exit 2
fi
if [[ ! -f "$CONFIG_FILE" ]]; then
  echo "error: CONFIG_FILE '$CONFIG_FILE' does not exist; pick one from ./train_configs/" >&2
  exit 2
fi

if [[ -z "${NGPU:-}" ]]; then
  NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 1)")
fi
NNODES=${NNODES:-1}
for name in NGPU NNODES; do
  if [[ ! "${!name}" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: $name=${!name} is not a positive whole number; set $name to the number of $([[ $name == NGPU ]] && echo "processes (GPUs) per node" || echo nodes)" >&2
    exit 2
  fi
done

if [[ "$NNODES" -gt 1 ]]; then
  if [[ -z "${RDZV_ENDPOINT:-}" ]]; then
    echo "error: NNODES=$NNODES needs RDZV_ENDPOINT: set RDZV_ENDPOINT=host:port of the rendezvous host (same on every node)" >&2
    exit 2
  fi
  RDZV=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-torchtitan}")
else
  RDZV=(--standalone)
fi

LOG_RANK=${LOG_RANK:-0}
FILTER=()
if [[ "$LOG_RANK" != "all" ]]; then
  IFS=, read -ra shown <<< "$LOG_RANK"
  for rank in "${shown[@]}"; do
    if [[ ! "$rank" =~ ^[0-9]+$ ]] || (( rank >= NGPU )); then
      echo "error: LOG_RANK=$LOG_RANK names local rank '$rank', but there are $NGPU per node (0-$((NGPU - 1))); set LOG_RANK=0, a list like 0,1, or all" >&2
      exit 2
    fi
  done
  FILTER=(--local-ranks-filter "$LOG_RANK" --role rank --tee 3)
fi

# Like torchtitan: the caching allocator grows segments instead of keeping fixed-size blocks, so the reserved peak
# stays near the allocated one (5-7 GiB less on 16B_bench4). A value the user set (either name) is kept.
if [[ -z "${PYTORCH_ALLOC_CONF:-}" && -z "${PYTORCH_CUDA_ALLOC_CONF:-}" ]]; then
  export PYTORCH_ALLOC_CONF=expandable_segments:True
fi

# The launcher checks the job (torchtitan/preflight.py) before torchrun starts any process: a bad config, degree or
# torchrun flag is one line (the variables above are checked first: bash answers at once, the launcher after its
# imports).
# shellcheck disable=SC2086
exec "$PYTHON" -m torchtitan.launch --nproc-per-node "$NGPU" "${RDZV[@]}" "${FILTER[@]}" ${TORCHRUN_ARGS:-} \
  -m torchtitan.train --job.config_file "$CONFIG_FILE" "$@"
