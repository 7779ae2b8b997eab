#!/usr/bin/env bash
# Create .venv (if missing) and install torchtitan with its test tools. Safe to re-run.
# torch is pinned: 2.13.0 is the CPU build on this project's machines; an unpinned torch would
# download a multi-GB CUDA build. On a CUDA machine the same pin installs PyPI's CUDA build.
# Each step says what it does and the seconds since the start; each package pip downloads is named.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
step() { echo "setup: $* ($((SECONDS - start)) s)" >&2; }
if [ ! -x .venv/bin/python ]; then
    step "creating .venv"
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    step "installing torch 2.13.0 (the largest download)"
    .venv/bin/python -m pip install "torch==2.13.0" | { grep -E "^(Collecting|  Downloading|Successfully installed)" || true; }
else
    step "torch 2.13.0 is installed"
fi
step "installing torchtitan and its test tools (pip install -e .[dev]: a minute or two even when all is installed)"
# What pip downloads and installs is shown (one line a package); what is already installed is not.
.venv/bin/python -m pip install -e ".[dev]" | { grep -E "^(Collecting|  Downloading|Successfully installed)" || true; }
step "done: source .venv/bin/activate"
