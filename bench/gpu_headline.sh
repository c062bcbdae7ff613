#!/usr/bin/env bash
# PipelineRL's headline on a GPU machine (UNVERIFIED: no GPU machine with Java has run it yet): the
# comparison of `make bench-headline` (configs/headline-cpu.yaml: the same task, model,
# hyper-parameters and target as the CPU figures) with the built-in engine and the trainer on CUDA,
# sharing GPU 0 (weights pushed over CUDA IPC: `weight_transport: auto`), and the engine's default
# decode shape: on a GPU a decode step of this model costs about the same at any batch occupancy
# by itself, so no emulation is needed. Four modes x 1 repeat, each run stopped at the target or
# after 100 s of training: within 8 minutes after the model is built.
#
#   make setup                       # once, with network: the environment and the Kafka jars
#   bash bench/gpu_headline.sh       # on the GPU machine: bench/results/headline-gpu.{json,md,png}
#
# Needs Java 17 (the local Kafka broker) and one CUDA GPU. Exits 3 with one line when either is
# missing, 1 if a run failed.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
command -v java >/dev/null || { echo "gpu_headline: no java on PATH (the local Kafka broker needs Java 17)" >&2; exit 3; }
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || { echo "gpu_headline: torch sees no CUDA GPU" >&2; exit 3; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# Our own process group: whatever a run leaves behind ends with this script.
trap 'kill -- -$$ 2>/dev/null' EXIT
MODEL=${HEADLINE_MODEL:-models/tiny-headline}
if [[ ! -f $MODEL/config.json ]]; then
  # The same warm start as the Makefile's (CPU; ~2 min on a many-core host).
  "$PY" -m stream_rl.cli make-model --preset tiny --warm-start progression --label-smoothing 0.035 \
    --task-params '{median_terms: 12, max_terms: 100}' --out "$MODEL" --overwrite || exit 1
fi
timeout --kill-after=10 470 "$PY" bench/pipeline_vs_conventional.py --config configs/headline-cpu.yaml \
  --modes conventional,pipeline,pipeline-recompute,pipeline-no-inflight --repeats 1 \
  --target 0.5 --stop-at-target --max-steps 400 --max-wall 100 \
  --set model.path="$MODEL" --set inference.device=cuda --set trainer.device=cuda \
  --set inference.decode_shape=running --name headline-gpu
rc=$?
echo "gpu_headline: exit $rc (bench/results/headline-gpu.{json,md,png})"
exit $rc
