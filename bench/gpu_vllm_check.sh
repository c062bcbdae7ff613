#!/usr/bin/env bash
# The vLLM checks of the CPU suite, on a GPU machine with vLLM installed, in one go; one results
# directory. Beside bench/gpu_check.sh (the built-in engine).
#
#   on the GPU machine:   bash bench/gpu_vllm_check.sh        # carry: .whl (bench/gpu_wheels.sh)
#
# Needs `import vllm` to work there (vLLM 0.33: `pip install -e ".[gpu]"`). Where it does not (the
# GPU machine this project is lent has no vLLM and no network, and vLLM's wheel is larger than
# what may be carried to it), it says so in one line and exits 3: nothing ran.
#
# What runs: tests/integration/test_vllm.py against a vLLM server on the GPU (the launcher's own
# command line: --generation-config vllm, processed logprobs, the guard), started twice: with
# CUDA graphs (vLLM's default) and with --enforce-eager. The tests' trainer runs on the CPU and
# pushes over `stream_rl_gloo` (one GPU: NCCL refuses a trainer and a server on the same device).
# They check logprobs against transformers at the sampling temperature (a model directory that
# carries a hub model's sampling defaults), exact version spans across `keep` and `recompute`
# updates in the middle of a long generation, a drain update, a trainer killed paused, mid-
# broadcast and between update and finish, the admin guard. Every push's receive_ms and
# stall_ms go to $OUT/vllm_gpu_timings.jsonl; the medians are printed per mode.
# Exit: 0 all passed, 1 a check failed, 3 vLLM not importable (nothing ran).
set -u -o pipefail
cd "$(dirname "$0")/.."
if ! version=$(python3 -c "import vllm; print(vllm.__version__)" 2>/dev/null); then
  echo "gpu_vllm_check: vLLM is not importable on this machine (python3 -c 'import vllm' fails): no vLLM check ran"
  exit 3
fi
. bench/gpu_site.sh
echo "gpu_vllm_check: vLLM $version, $(python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())')"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export STREAM_RL_VLLM_PYTHON="$(command -v python3)" STREAM_RL_VLLM_DEVICE=cuda
export STREAM_RL_VLLM_TIMINGS="$OUT_DIR/vllm_gpu_timings.jsonl"
rm -f "$STREAM_RL_VLLM_TIMINGS"
trap 'kill -- -$$ 2>/dev/null' EXIT
rc=0
for graphs in on off; do
  eager=$([ "$graphs" = on ] && echo 0 || echo 1)
  echo "== CUDA graphs $graphs"
  STREAM_RL_VLLM_EAGER=$eager timeout --kill-after=10 300 python3 -m pytest tests/integration/test_vllm.py \
    -m vllm -p no:cacheprovider -q -rA --junitxml="$OUT_DIR/vllm_gpu_graphs_$graphs.xml" || rc=1
done
python3 - "$STREAM_RL_VLLM_TIMINGS" <<'EOF'
import json, statistics, sys
from pathlib import Path
path = Path(sys.argv[1])
rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
for pause in sorted({r["pause"] for r in rows}):
    got = [r for r in rows if r["pause"] == pause]
    print(f"{pause:10s} pushes {len(got):3d}  receive_ms median {statistics.median(r['receive_ms'] for r in got):8.1f}"
          f"  stall_ms median {statistics.median(r['stall_ms'] for r in got):8.1f}")
EOF
echo "gpu_vllm_check: exit $rc (results in $OUT_DIR)"
exit $rc
