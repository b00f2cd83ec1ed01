#!/usr/bin/env bash
# The session's closing GPU call: nano V2 (+ HF baseline, GPU idle probe), nano V1, then the GPU tests.
set -uo pipefail
out=${1:?usage: scripts/gpu_final.sh OUT_DIR}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device-wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
filter() { grep -v -E "(it|req|batch)/s\]|s/(it|req|batch)\]"; }
timeout 330 python3 -m framework.entrypoints.cli bench experiment=nano bench.output_dir="$out/v2" 2>&1 | tee "$out/v2.log" | filter | tail -8
timeout 110 python3 -m framework.entrypoints.cli bench experiment=nano runner=v1 bench.baselines=[] bench.decode_idle_batch=0 \
  bench.output_dir="$out/v1" 2>&1 | tee "$out/v1.log" | filter | tail -5
timeout 100 python3 -m pytest -q -x tests/gpu/test_sampler_gpu.py tests/gpu/test_gpu_engine.py 2>&1 | tee "$out/gpu_tests.log" | tail -12
