#!/usr/bin/env bash
# Tensor / pipeline parallel scaling on 2 GPUs ("nano", Qwen3-0.6B and Qwen3-8B geometries): 5-7 minutes.
# Extra arguments go to scripts/bench_parallel.py (e.g. --cases 0.6b-tp1 0.6b-tp2 --num-requests-8b 128).
set -uo pipefail
out=${1:?usage: scripts/bench_parallel.sh OUT_DIR [bench_parallel.py args]}
if compgen -G ".device-wheels/*.whl" >/dev/null; then  # hydra / pydantic for a bare GPU machine, as gpu_final.sh
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device-wheels/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
timeout 590 python3 scripts/bench_parallel.py --out "$out" "${@:2}"
