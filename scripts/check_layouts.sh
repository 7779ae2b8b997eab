#!/usr/bin/env bash
# Run every layout command of docs/parallelism.md's layout table for a few steps and print each one's
# last logged loss; exit non-zero if any fails. The table is the single list of layouts.
#   bash scripts/check_layouts.sh [extra overrides, default: --training.steps 4 --lr_scheduler.warmup_steps 1]
set -uo pipefail
cd "$(dirname "$0")/.."
extra=("$@")
if [ ${#extra[@]} -eq 0 ]; then extra=(--training.steps 4 --lr_scheduler.warmup_steps 1 --metrics.log_freq 2); fi
out=$(mktemp -d)
failed=0
n=0
while IFS= read -r cmd; do
    n=$((n + 1))
    log="${out}/layout_${n}.log"
    start=$(date +%s)
    if env LOG_RANK=0 bash -c "${cmd} --job.dump_folder ${out}/run_${n} --metrics.no-enable_tensorboard ${extra[*]}" >"${log}" 2>&1; then
        loss=$(grep -o '"loss": [0-9.]*' "${out}/run_${n}/metrics.jsonl" | tail -1 | cut -d' ' -f2)
        echo "ok    $(( $(date +%s) - start ))s  loss ${loss}  ${cmd}"
    else
        failed=$((failed + 1))
        echo "FAIL  ${cmd}  (log: ${log})"
    fi
done < <(grep -o '^| [^|]* | `NGPU=[^`]*`' docs/parallelism.md | sed 's/.*`\(NGPU=[^`]*\)`/\1/')
echo "${n} layouts, ${failed} failed"
[ "${failed}" -eq 0 ] && [ "${n}" -gt 0 ]
