#!/usr/bin/env bash
# Create .venv (if missing) and install torchtitan with its test tools. Safe to re-run.
# torch is pinned: 2.13.0 is the CPU build on this project's machines; an unpinned torch would
# download a multi-GB CUDA build. On a CUDA machine the same pin installs PyPI's CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[dev]"
