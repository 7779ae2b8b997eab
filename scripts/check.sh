#!/usr/bin/env bash
# The project's checks, in stages, stopping at the first that fails (CI runs exactly this, after
# scripts/setup.sh; run it inside .venv):
#   1. lint, format and types: ruff check, ruff format --check, pyrefly check (seconds);
#   2. the quick tests: pytest -m "not slow" (single-process tests; a few minutes);
#   3. the rest: pytest -m slow (multi-process launches, compile, the parity matrix).
# Arguments go to both pytest stages (`bash scripts/check.sh -x`). `--stage N` runs only stage N.
set -euo pipefail
cd "$(dirname "$0")/.."

only=""
if [ "${1:-}" = "--stage" ]; then
    only="${2:?--stage needs a number: 1 (lint, format, types), 2 (quick tests) or 3 (slow tests)}"
    case "$only" in
        1 | 2 | 3) ;;
        *)
            echo "check: --stage $only: no such stage; use 1 (lint, format, types), 2 (quick tests) or 3 (slow tests)" >&2
            exit 2
            ;;
    esac
    shift 2
fi
run_stage() { [ -z "$only" ] || [ "$only" = "$1" ]; }
start=$SECONDS

if run_stage 1; then
    echo "check: stage 1/3: lint, format and types (ruff check, ruff format --check, pyrefly check)"
    ruff check .
    ruff format --check .
    pyrefly check
fi
if run_stage 2; then
    echo "check: stage 2/3: quick tests (python -m pytest -q -ra -m \"not slow\" $*) ($((SECONDS - start)) s)"
    python -m pytest -q -ra -m "not slow" "$@"
fi
if run_stage 3; then
    echo "check: stage 3/3: slow tests (python -m pytest -q -ra -m slow $*) ($((SECONDS - start)) s)"
    python -m pytest -q -ra -m slow "$@"
fi
echo "check: passed ($((SECONDS - start)) s)"
