#!/usr/bin/env bash
# One GPU-machine call: install the carried wheels, run the GPU tests, the attention benchmark and "nano".
# Usage (from the repo root on the GPU machine): scripts/gpu_run.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_run.sh OUT_DIR}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device-wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -m pytest -q tests/gpu 2>&1 | tee "$out/gpu_tests.log" | tail -15
python3 -m framework.cli bench experiment=nano bench.output_dir="$out/nano" 2>&1 | tee "$out/nano.log" \
  | grep -v -E "(it|req|batch)/s\]|s/(it|req|batch)\]" | tail -12
