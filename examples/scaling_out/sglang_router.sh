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
# cache_aware: a prompt matching > --cache-threshold of a replica's routed prompts goes there; any other prompt to
# the replica with the fewest requests in flight (the first on a tie: under light traffic, every new prefix lands
# on replica 0); load imbalance beyond both balance thresholds falls back to the least loaded (docs/scaling-out.md).
python -m sglang_router.launch_router --worker-urls "${urls[@]}" --policy cache_aware \
  --cache-threshold 0.5 --balance-abs-threshold 64 --balance-rel-threshold 1.5 \
  --health-check-interval-secs 5 --health-failure-threshold 2 --retry-max-retries 3 \
  --host 127.0.0.1 --port 30000
