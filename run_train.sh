#!/usr/bin/env bash
# Launch training with torchrun on one machine.
#   NGPU         processes to start (GPUs on a CUDA machine, CPU processes otherwise); default 2
#   CONFIG_FILE  TOML recipe; default train_configs/debug_model.toml
#   LOG_RANK     comma list of ranks whose output is shown; default 0
# Extra arguments are config overrides, e.g. ./run_train.sh --training.steps 50
set -euo pipefail

NGPU=${NGPU:-2}
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_model.toml"}
LOG_RANK=${LOG_RANK:-0}
PYTHON=${PYTHON:-python}

# Config, degrees and files are checked once before starting processes, so a mistake costs a second.
# Exit status 3 means --help was printed.
status=0
WORLD_SIZE=${NGPU} ${PYTHON} -m torchtitan.preflight --job.config_file "${CONFIG_FILE}" "$@" || status=$?
if [ "${status}" -eq 3 ]; then exit 0; fi
if [ "${status}" -ne 0 ]; then exit "${status}"; fi

exec ${PYTHON} -m torch.distributed.run --nproc_per_node="${NGPU}" --rdzv_backend=c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter="${LOG_RANK}" --role=rank --tee=3 \
    -m torchtitan.train --job.config_file "${CONFIG_FILE}" "$@"
