#!/bin/bash
# One machine, no scheduler: check the layout, then torchrun --standalone (it picks a free port).
#
#   launch/run_local.sh                                     # configs/tiny_cpu.yaml, 2 processes
#   launch/run_local.sh configs/gsm8k_grpo_1node_6gpu.yaml trainer.total_training_steps=10
#   NPROC_PER_NODE=4 launch/run_local.sh configs/X.yaml     # 4 processes, whatever the config says
#
# The config is the first argument (or $CONFIG); every key=value after it reaches train_ppo.py
# unchanged and in order. The number of processes is the config's trainer.n_gpus_per_node (after the
# overrides), so the launch always matches the plan; NPROC_PER_NODE=k instead sets
# trainer.nnodes=1 trainer.n_gpus_per_node=k. An invalid layout, or a config for more than one
# node, exits with status 1 before any process starts.
#
# Environment [default]:
#   CONFIG          [configs/tiny_cpu.yaml]
#   NPROC_PER_NODE  [the config's trainer.n_gpus_per_node]
#   VENV            python environment whose bin/ goes first on PATH [<repo>/.venv]

set -euo pipefail

cd "$(dirname "$0")/.."
if [[ $# -gt 0 && $1 != *=* ]]; then
  CONFIG=$1
  shift
fi
CONFIG=${CONFIG:-configs/tiny_cpu.yaml}
VENV=${VENV:-$PWD/.venv}
export PATH="$VENV/bin:$PATH"
if [[ -n ${NPROC_PER_NODE:-} ]]; then
  set -- trainer.nnodes=1 trainer.n_gpus_per_node="$NPROC_PER_NODE" "$@"
fi

# The planner resolves the config and checks the layout (exit 1 with the reason on stderr).
plan=$(python mesh_utils.py --config "$CONFIG" --json "$@")
read -r NNODES NPROC < <(python -c 'import json, sys; d = json.load(sys.stdin)["dims"]; print(d["nnodes"], d["n_gpus_per_node"])' <<<"$plan")
if [[ $NNODES != 1 ]]; then
  echo "run_local.sh runs one node, but trainer.nnodes=$NNODES: use launch/slurm_multinode.sbatch," \
    "or set NPROC_PER_NODE=<processes> to run the job on this machine alone." >&2
  exit 1
fi

# PyTorch's NCCL flight recorder: on a collective timeout every rank dumps its last collectives into
# the run's logs/ (read them with torchfrtrace, docs/hangs.md). Set any of these to override.
OUT_DIR=$(python -c 'import sys; from config import load_config
print(load_config(sys.argv[1], sys.argv[2:]).trainer.default_local_dir)' "$CONFIG" "$@")
[[ $OUT_DIR == /* ]] || OUT_DIR=$PWD/$OUT_DIR
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$OUT_DIR/logs/nccl_trace_rank_}
mkdir -p "$OUT_DIR/logs"

torchrun --standalone --nproc_per_node="$NPROC" train_ppo.py --config "$CONFIG" "$@"
