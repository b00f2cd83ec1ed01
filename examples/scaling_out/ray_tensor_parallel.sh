#!/usr/bin/env bash
# Tensor parallel over the GPUs of a Ray cluster: one placement-group bundle per rank, the driver (rank 0) serves
# (docs/scaling-out.md, "Multi-node tensor and pipeline parallel").
#   pip install "mrv2[ray]"; ray start --head (and `ray start --address=HEAD:6379` on each other node)
#   TP=2 bash examples/scaling_out/ray_tensor_parallel.sh     # then: openai client at http://<rank-0 node>:8000/v1
set -euo pipefail
TP=${TP:-2}
python -m framework.executor.ray_launch --world-size "$TP" --strategy "${STRATEGY:-PACK}" -- \
  python -m framework.entrypoints.cli serve parallel.tensor_parallel_size="$TP" serve.host=0.0.0.0 serve.port=8000
