#!/usr/bin/env bash
# Launch training: check the job, then start its workers with torchrun (python -m torchtitan.launch).
#   NGPU           processes to start on this node (GPUs on a CUDA machine, CPU processes otherwise); default 2
#   CONFIG_FILE    TOML recipe; default train_configs/debug_model.toml
#   LOG_RANK       comma list of local ranks whose output is shown; default 0
#   MAX_RESTARTS   restarts of all workers after one fails (torchrun --max-restarts); default 0
# Several nodes (run the same command on each; scripts/multinode_trainer.slurm does it under SLURM):
#   NNODES         nodes in the job; default 1
#   NODE_RANK      this node's rank, 0..NNODES-1 (optional: c10d rendezvous assigns ranks; node 0 hosts
#                  the rendezvous store and checks the dump folder's lock)
#   RDZV_ENDPOINT  HOST:PORT of node 0's rendezvous store; required when NNODES > 1
#   RDZV_ID        job id, the same on every node; default torchtitan
#   RDZV_TIMEOUT   seconds to wait for node 0's store to answer (at most 60 without NODE_RANK) and for every
#                  node to join; default 600
#   LOG_DIR        folder for every worker's stdout/stderr; default a temporary folder
#   WORKER_START   fork (workers forked from the launcher: no second torch import; the default without
#                  CUDA) or exec (python -m torchtitan.train; the default with CUDA)
# Fault tolerance (replica groups, [fault_tolerance]; docs/launching.md):
#   LIGHTHOUSE_PORT  for replica groups on one machine: once the job is checked, start a torchft lighthouse on
#                  127.0.0.1:PORT unless one answers there already (groups launched together start one between
#                  them; it keeps running for the other groups and for restarts: stop it with kill, its pid is
#                  printed) and pass --fault_tolerance.lighthouse http://127.0.0.1:PORT
# Extra arguments are config overrides, e.g. ./run_train.sh --training.steps 50
set -euo pipefail

NGPU=${NGPU:-2}
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_model.toml"}
LOG_RANK=${LOG_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-}
RDZV_ID=${RDZV_ID:-torchtitan}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-600}
PYTHON=${PYTHON:-python}

need_int() {  # name value minimum
    if ! [[ "$2" =~ ^[0-9]+$ ]] || [ "$2" -lt "$3" ]; then
        echo "error: $1 must be an integer >= $3, got '$2'" >&2
        exit 2
    fi
}
need_int NGPU "${NGPU}" 1
need_int NNODES "${NNODES}" 1
need_int MAX_RESTARTS "${MAX_RESTARTS}" 0
need_int RDZV_TIMEOUT "${RDZV_TIMEOUT}" 1
if [ -n "${NODE_RANK}" ]; then need_int NODE_RANK "${NODE_RANK}" 0; fi
if [ "${NNODES}" -gt 1 ] && [ -z "${RDZV_ENDPOINT}" ]; then
    echo "error: NNODES=${NNODES} needs RDZV_ENDPOINT=HOST:PORT, the address of node 0 (the same on every node)" >&2
    exit 2
fi

if [ -n "${LIGHTHOUSE_PORT:-}" ]; then need_int LIGHTHOUSE_PORT "${LIGHTHOUSE_PORT}" 1; fi
if ! command -v "${PYTHON}" > /dev/null 2>&1; then
    echo "error: no '${PYTHON}' command: activate the project's environment (source .venv/bin/activate; bash" \
         "scripts/setup.sh creates it)" >&2
    exit 2
fi

# One Python process checks the job (a mistake is one message and exit status 2 before any worker
# starts), then runs torchrun, whose workers on a CPU machine are forked from it.
opts=(--nproc-per-node "${NGPU}" --nnodes "${NNODES}" --rdzv-id "${RDZV_ID}" --rdzv-timeout "${RDZV_TIMEOUT}"
      --max-restarts "${MAX_RESTARTS}" --log-rank "${LOG_RANK}")
if [ -n "${NODE_RANK}" ]; then opts+=(--node-rank "${NODE_RANK}"); fi
if [ -n "${RDZV_ENDPOINT}" ]; then opts+=(--rdzv-endpoint "${RDZV_ENDPOINT}"); fi
if [ -n "${LOG_DIR:-}" ]; then opts+=(--log-dir "${LOG_DIR}"); fi
if [ -n "${WORKER_START:-}" ]; then opts+=(--worker-start "${WORKER_START}"); fi
if [ -n "${LIGHTHOUSE_PORT:-}" ]; then opts+=(--lighthouse-port "${LIGHTHOUSE_PORT}"); fi

exec ${PYTHON} -m torchtitan.launch "${opts[@]}" -- --job.config_file "${CONFIG_FILE}" "$@"
