#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels bench/gpu_check.sh installs on the GPU
# machine: what the project imports that its image lacks (pydantic, fastapi, starlette, uvicorn,
# fastavro, opentelemetry-api for fastapi) and the pinned transformers (the image has 5.17; the
# project pins 5.24.0, whose engine/cache API and numerics the CPU suite checks). Versions are
# those of the project's .venv (pyproject.toml). Linux x86-64, CPython 3.12. ~25 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 fastavro==1.13.1 \
  opentelemetry-api==1.45.2 transformers==5.24.0 regex==2026.11.19
ls -la .whl
du -sh .whl
