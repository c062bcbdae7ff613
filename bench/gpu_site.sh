# Sourced by bench/gpu_check.sh and bench/gpu_vllm_check.sh, from the repository root: OUT_DIR
# made, the carried wheels (.whl/, from bench/gpu_wheels.sh) installed into /tmp/site, and
# PYTHONPATH set to them and this checkout.
OUT_DIR="${OUT:-bench/results}"
mkdir -p "$OUT_DIR"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no .whl/ here: using the installed packages (run bench/gpu_wheels.sh first to carry the missing ones)" >&2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
