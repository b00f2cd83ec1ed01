#!/usr/bin/env bash
# Named pieces of GPU work, run in turn on the GPU machine from the repository root, each under its own time limit:
#   tests/gpu/run_pieces.sh OUT_DIR PIECE...
# Pieces:
#   gpu_tests_all    the whole tests/gpu suite in one pytest run (every file; needs 2 GPUs for the parallel tests)
#   gpu_tests_first  GPU_PIECES below, one pytest run per group (fits one 600 s device call)
#   gpu_tests_more   GPU_PIECES_MORE below, the same way (fits a second call)
#   gpu_tests_extra  GPU_PIECES_EXTRA below, the same way (a third call)
#   gpu_tests_last   GPU_PIECES_LAST below, the same way (a fourth call); the four lists hold every tests/gpu file
#   gpu_tests_xdist  every tests/gpu file in one call: pytest-xdist workers sharing the one GPU (one file per worker
#                    at a time), for sessions with device time for a single call; needs pytest-xdist in .device-wheels
#   nano             `mrv2 bench experiment=nano` (V2, HF baseline, idle probe), bench.json under OUT_DIR/nano
#   v1_nano          the same requests on the V1 runner, no HF baseline or idle probe, under OUT_DIR/v1_nano
#   kv_groups_memory `mrv2 bench experiment=gemma3_long` with cache.kv_groups=true, then false (OUT_DIR/gemma3_long_groups,
#                    OUT_DIR/gemma3_long_full); OUT_DIR/kv_groups_ratio/log.txt: full / grouped KV bytes per token
#   quant_bench      the FP8 / INT4 linear and MoE kernel benchmarks, then the Qwen3-8B geometry's nano (128
#                    requests) in bf16 and online FP8 (docs/quantization.md "Speed")
#   lora_bench       benchmarks/lora/bench_lora_kernels.py (LoRA shrink / expand launch variants against the base GEMM,
#                    Qwen3-0.6B and 8B groups; lora_kernels.json / .png under OUT_DIR/lora_kernels), then
#                    benchmarks/lora/bench_lora.py --rounds 2 (nano, base vs 1 and 8 adapters; docs/lora.md "Speed";
#                    extra arguments in LORA_BENCH_ARGS, e.g. "--split-k-max-tokens 512" for the split-K shrink)
#   qwen3_5_bench    `mrv2 bench experiment=qwen3_5` (nano on the Qwen3.5-0.8B geometry), then
#                    `experiment=prefix_bench_qwen3_5` (caching off, then on) under OUT_DIR/qwen3_5, OUT_DIR/qwen3_5_prefix
#   moe_tune         benchmarks/moe/tune_moe_tiles.py (the fused MoE tile table of this GPU, Qwen3-30B-A3B bf16; extra
#                    arguments in MOE_TUNE_ARGS, e.g. "--quick" or "--geometry gpt-oss-20b") under OUT_DIR/moe_tune:
#                    copy its <GPU>.json to framework/layers/kernels/moe_configs/ (docs/moe.md, "Tuned tiles")
# Every test piece ends with tests/gpu/summary.py (totals, every failure and skip, GPU files no group ran, commit)
# in OUT_DIR/<piece>_summary.txt; each piece's log is OUT_DIR/<name>/log.txt and OUT_DIR/summary.log has the tails.
# .device-wheels/ (carried to the device, if present) holds Python 3.12 wheels of what the device lacks (pydantic,
# hydra-core, omegaconf, antlr4, msgspec, llguidance, jsonschema and its dependencies).
set -uo pipefail
out=${1:?usage: tests/gpu/run_pieces.sh OUT_DIR PIECE...}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
if compgen -G ".device-wheels/*.whl" >/dev/null && [ ! -d /tmp/site/pydantic ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device-wheels/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

step() { # name, limit (s), command...: the command's log in OUT/name/log.txt, GPU clocks and load in OUT/name/smi.csv
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS smi=""
  mkdir -p "$out/$name"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
      --format=csv -lms 500 >"$out/$name/smi.csv" 2>/dev/null &
    smi=$!
  fi
  # SIGINT first: pytest stops like a Ctrl-C and still writes its junit XML and summary (what passed, what failed)
  timeout -s INT -k 30 "$limit" "$@" >"$out/$name/log.txt" 2>&1
  local rc=$?
  [ -n "$smi" ] && kill "$smi" 2>/dev/null
  echo "== $name rc=$rc $((SECONDS - t0))s" | tee -a "$out/summary.log"
  grep -v -E "(it|req|batch|tok)/s\]|s/(it|req|batch)\]" "$out/$name/log.txt" | tail -25 >>"$out/summary.log"
  return $rc
}

# Groups of tests/gpu files: "name limit_s files...". Each list's limits sum to <= 580 s (one device call may run
# 600 s); every tests/gpu/test_*.py file is in exactly one of the two lists (tests/test_ci_checks.py checks both).
GPU_PIECES=(
  "kernels 30 test_layer_ops_gpu.py test_random_weights_gpu.py"
  "sampler 70 test_sampler_fused_gpu.py test_sampler_gpu.py"
  "spec 120 test_spec_gpu.py test_draft_heads_gpu.py"
  "engine 95 test_gpu_engine.py test_prefix_caching_gpu.py"
  "hybrid_whisper 90 test_whisper_gpu.py test_mamba_gpu.py"
  "parallel 50 test_parallel_gpu.py test_parallel_quant_gpu.py"
  "structured 35 test_structured_gpu.py"
  "moe 90 test_fused_moe_gpu.py"
)
GPU_PIECES_MORE=(
  "smallbatch 160 test_small_batch_gpu.py"
  "fullgraph 120 test_full_step_graphs_gpu.py"
  "pdl 70 test_pdl_gpu.py"
  "prefill 90 test_prefill_attention_gpu.py"
  "prefillgraphs 80 test_prefill_graphs_gpu.py"
  "attention 60 test_attention_gpu.py"
)
GPU_PIECES_EXTRA=(
  "quantization 180 test_quantization_gpu.py test_gpt_oss_moe_gpu.py"
  "window 90 test_window_sinks_gpu.py"
  "gemma3 100 test_gemma3_gpu.py test_kv_groups_gpu.py"
  "quantrank 10 test_quant_rank_layout_gpu.py"
  "quantgemv 110 test_quant_gemv_gpu.py"
  "gptosstp 90 test_parallel_gpt_oss_gpu.py"
)
GPU_PIECES_LAST=(
  "kvtier 70 test_host_kv_tier_gpu.py"
  "lora 90 test_lora_gpu.py"
  "gdn 100 test_gdn_gpu.py"
  "gdnparallel 120 test_parallel_gdn_gpu.py"
  "gemma4 120 test_gemma4_gpu.py"
  "moetune 80 test_moe_tune_gpu.py"
)

test_groups() { # piece, name of a groups array: one pytest run per group, then the summary of exactly those files
  local piece=$1
  local -n groups=$2
  local xml="$out/$piece/junit" expect="" group name limit files
  mkdir -p "$xml"
  rm -f "$xml"/*.xml
  for group in "${groups[@]}"; do
    read -r name limit files <<<"$group"
    expect="$expect $files"
    # shellcheck disable=SC2046  # one word per file
    step "$piece-$name" "$limit" python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$xml/$name.xml" \
      $(printf 'tests/gpu/%s ' $files)
  done
  # shellcheck disable=SC2086
  step "$piece-summary" 30 python3 tests/gpu/summary.py "$xml" --expect $expect
  cp "$out/$piece-summary/log.txt" "$out/${piece}_summary.txt"
}

for piece in "$@"; do
  case $piece in
    gpu_tests_all)
      mkdir -p "$out/gpu_tests_all/junit"
      step gpu_tests_all 1800 python3 -m pytest -q -rs -p no:cacheprovider \
        --junitxml="$out/gpu_tests_all/junit/all.xml" tests/gpu
      step gpu_tests_all-summary 30 python3 tests/gpu/summary.py "$out/gpu_tests_all/junit"
      cp "$out/gpu_tests_all-summary/log.txt" "$out/gpu_tests_all_summary.txt"
      ;;
    gpu_tests_xdist)
      mkdir -p "$out/gpu_tests_xdist/junit"
      # -v: every test's result reaches the log as it finishes, so a run stopped at its limit still says what passed
      step gpu_tests_xdist "${GPU_XDIST_LIMIT:-560}" python3 -m pytest -v -rs -p no:cacheprovider --durations=25 \
        -n "${GPU_XDIST_WORKERS:-4}" --dist loadfile --junitxml="$out/gpu_tests_xdist/junit/all.xml" tests/gpu
      step gpu_tests_xdist-summary 30 python3 tests/gpu/summary.py "$out/gpu_tests_xdist/junit"
      cp "$out/gpu_tests_xdist-summary/log.txt" "$out/gpu_tests_xdist_summary.txt"
      ;;
    gpu_tests_first) test_groups gpu_tests_first GPU_PIECES ;;
    gpu_tests_more) test_groups gpu_tests_more GPU_PIECES_MORE ;;
    gpu_tests_extra) test_groups gpu_tests_extra GPU_PIECES_EXTRA ;;
    gpu_tests_last) test_groups gpu_tests_last GPU_PIECES_LAST ;;
    nano) step nano 330 python3 -m framework.entrypoints.cli bench experiment=nano bench.output_dir="$out/nano" ;;
    v1_nano)
      step v1_nano 300 python3 -m framework.entrypoints.cli bench experiment=nano runner=v1 bench.baselines=[] \
        bench.decode_idle_batch=0 bench.output_dir="$out/v1_nano"
      ;;
    kv_groups_memory)
      for groups in true false; do
        name=gemma3_long_$([ "$groups" = true ] && echo groups || echo full)
        step "$name" 280 python3 -m framework.entrypoints.cli bench experiment=gemma3_long cache.kv_groups=$groups \
          bench.output_dir="$out/$name"
      done
      step kv_groups_ratio 30 python3 -c 'import json, sys
r = [json.load(open(sys.argv[1] + "/gemma3_long_" + n + "/bench.json"))["results"][0]["kv_bytes_per_token"]
     for n in ("groups", "full")]
print("KV bytes per token: groups %.0f, full %.0f, full / groups = %.2fx" % (r[0], r[1], r[1] / r[0]))' "$out"
      ;;
    quant_bench)
      step quant_kernels 150 python3 benchmarks/quantization/bench_fp8_linear.py --out "$out/fp8_linear.json"
      step quant_moe 120 python3 benchmarks/quantization/bench_fp8_moe.py --out "$out/fp8_moe.json"
      for fmt in bf16 fp8; do
        quant=""
        [ "$fmt" = fp8 ] && quant="model.quantization=fp8"
        # shellcheck disable=SC2086  # an empty $quant adds no argument
        step "q8_$fmt" 150 python3 -m framework.entrypoints.cli bench experiment=nano model.preset=qwen3-8b \
          bench.num_requests=128 bench.baselines=[] bench.decode_idle_batch=0 $quant bench.output_dir="$out/q8_$fmt"
      done
      ;;
    lora_bench)
      step lora_kernels 240 python3 benchmarks/lora/bench_lora_kernels.py --out "$out/lora_kernels/lora_kernels"
      # shellcheck disable=SC2086  # LORA_BENCH_ARGS: one word per argument
      step lora_nano 340 python3 benchmarks/lora/bench_lora.py --rounds 2 --out "$out/lora_nano/lora_bench" \
        ${LORA_BENCH_ARGS:-}
      ;;
    qwen3_5_bench)
      step qwen3_5 300 python3 -m framework.entrypoints.cli bench experiment=qwen3_5 bench.output_dir="$out/qwen3_5"
      step qwen3_5_prefix 240 python3 -m framework.entrypoints.cli bench experiment=prefix_bench_qwen3_5 \
        bench.output_dir="$out/qwen3_5_prefix"
      ;;
    moe_tune)
      # shellcheck disable=SC2086  # MOE_TUNE_ARGS: one word per argument
      step moe_tune 595 python3 benchmarks/moe/tune_moe_tiles.py --out "$out/moe_tune" ${MOE_TUNE_ARGS:-}
      ;;
    *) echo "unknown piece $piece (see the head of tests/gpu/run_pieces.sh)" | tee -a "$out/summary.log" ;;
  esac
done
