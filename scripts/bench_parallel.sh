#!/usr/bin/env bash
# Tensor / pipeline parallel scaling on 2 GPUs ("nano", Qwen3-0.6B and Qwen3-8B geometries); about 6 minutes.
set -uo pipefail
out=${1:?usage: scripts/bench_parallel.sh OUT_DIR}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
timeout 600 python3 scripts/bench_parallel.py --out "$out" "${@:2}"
