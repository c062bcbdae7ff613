#!/usr/bin/env bash
# Every GPU test and benchmark of the built-in engine, on one GPU machine (H200: Python 3.12,
# torch 2.11, transformers 5.17, no network), in <= 8 minutes; one results file.
#
#   here (with network), once:  bash bench/gpu_wheels.sh          # fills .whl/ (gitignored)
#   on the GPU machine:         bash bench/gpu_check.sh           # carry: .whl
#
# Installs the carried wheels into /tmp/site (the packages the machine lacks, and the pinned
# transformers), runs bench/gpu_check.py, writes ${OUT:-bench/results}/gpu_check.json, and exits
# non-zero if any check failed. Every step runs in its own process group, killed at its end.
set -u -o pipefail
cd "$(dirname "$0")/.."
. bench/gpu_site.sh
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# Our own process group: whatever a step leaves behind ends with this script.
trap 'kill -- -$$ 2>/dev/null' EXIT
timeout --kill-after=10 470 python3 bench/gpu_check.py --out "$OUT_DIR/gpu_check.json"
rc=$?
echo "gpu_check: exit $rc (results in $OUT_DIR/gpu_check.json)"
exit $rc
