#!/usr/bin/env bash
# N `mrv2 serve` replicas behind SGLang Model Gateway's cache-aware policy (docs/scaling-out.md).
#   pip install sglang-router
#   N=2 DEVICE=cpu bash examples/scaling_out/sglang_router.sh     # then: openai client at http://127.0.0.1:30000/v1
set -euo pipefail
N=${N:-2}
DEVICE=${DEVICE:-auto}
urls=()
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
for ((i = 0; i < N; i++)); do
  port=$((8000 + i))
  CUDA_VISIBLE_DEVICES=$i mrv2 serve serve.port=$port device=$DEVICE cache.enable_prefix_caching=true &
  pids+=($!)
  urls+=("http://127.0.0.1:$port")
done
for url in "${urls[@]}"; do  # wait until each replica answers /health
  until curl -sf "$url/health" >/dev/null; do sleep 1; done
done
python -m sglang_router.launch_router --worker-urls "${urls[@]}" --policy cache_aware \
  --host 127.0.0.1 --port 30000
