#!/usr/bin/env bash
# One device call running several GPU jobs in turn, each under its own time limit; results packed into one
# archive after every job (a device call returns at most 8 files): OUT/results.tgz, OUT/summary.log.
#   scripts/gpu_batch.sh OUT_DIR JOB...      jobs: see the case list below
# The list keeps the jobs that reproduce a figure of docs/ or are reusable checks; the one-off jobs of finished
# investigations that the docs name (s11_final ... s20_targets, issue25_*) are in git: `git show a627dad:scripts/gpu_batch.sh`.
# .device-wheels/ (carried to the device) holds Python 3.12 wheels of what the device lacks: ../shared/device-wheels/*
# (pydantic, hydra-core, omegaconf, antlr4), msgspec, llguidance, and jsonschema with its dependencies (attrs,
# referencing, jsonschema-specifications, rpds-py; test_structured_gpu.py): `pip download -d .device-wheels
# --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 ... NAME`.
set -uo pipefail
out=${1:?usage: scripts/gpu_batch.sh OUT_DIR JOB...}; shift
res=/tmp/gpu_results; mkdir -p "$res" "$out"
[ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .device-wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
quiet() { grep -v -E "(it|req|batch|tok)/s\]|s/(it|req|batch)\]|Writing model shards"; }
job() {  # name, limit (s), command...
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  mkdir -p "$res/$name"
  # GPU clocks, power and load every 0.5 s while the job runs: run-to-run spread can then be told from a slow card.
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu --format=csv \
    -lms 500 > "$res/$name/smi.csv" 2>/dev/null & local smi=$!
  timeout "$limit" "$@" > "$res/$name/log.txt" 2>&1; local rc=$?
  kill $smi 2>/dev/null
  echo "== $name rc=$rc $((SECONDS - t0))s" | tee -a "$out/summary.log"
  quiet < "$res/$name/log.txt" | tail -25 >> "$out/summary.log"
  tar -czf "$out/results.tgz" -C "$res" .
}
# The whole tests/gpu suite in pieces, each under its own limit (at most 580 s in all; run on nvidia-h200-x2, since the
# parallel piece needs 2 GPUs), then the pass/fail summary (scripts/gpu_tests_summary.py: totals, every failure
# and skip, GPU test files no piece ran, commit and date) for docs/benchmarks.md. A new tests/gpu file joins a piece.
GPU_PIECES=(
  "kernels 30 test_layer_ops_gpu.py test_random_weights_gpu.py"
  "sampler 70 test_sampler_fused_gpu.py test_sampler_gpu.py"
  "spec 120 test_spec_gpu.py test_draft_heads_gpu.py"
  "engine 95 test_gpu_engine.py test_prefix_caching_gpu.py"
  "hybrid_whisper 90 test_whisper_gpu.py test_mamba_gpu.py"
  "parallel 50 test_parallel_gpu.py"
  "structured 35 test_structured_gpu.py"
  "moe 90 test_fused_moe_gpu.py"
)
# Pieces that no longer fit GPU_PIECES' one device call: `gpu_tests_more` runs them the same way (its own call,
# at most 580 s too). Every tests/gpu file is in exactly one of the two lists (tests/project/test_ci_checks.py).
GPU_PIECES_MORE=(
  "smallbatch 160 test_small_batch_gpu.py"
  "fullgraph 120 test_full_step_graphs_gpu.py"
  "pdl 70 test_pdl_gpu.py"
  "prefill 90 test_prefill_attention_gpu.py"
  "prefillgraphs 80 test_prefill_graphs_gpu.py"
  "attention 60 test_attention_gpu.py"
)
# The issue-25 targets paired over configurations: nano, the Qwen3-8B geometry (128 requests) and batch 1, each a
# `scripts/bench_matrix.py` call with the given rounds over the configurations (NAME=OVERRIDES, in that order).
paired_targets() {  # job, nano rounds, 8B rounds, batch-1 rounds, configurations...
  local j=$1 rn=$2 r8=$3 r1=$4; shift 4
  local cfg=() c; for c in "$@"; do cfg+=(--config "$c"); done
  local no_extras="bench.baselines=[] bench.decode_idle_batch=0"  # no HF baseline, no idle probe
  job $j-nano $((20 + 90 * rn)) python3 scripts/bench_matrix.py --out "$res/$j/nano" --rounds $rn --timeout 60 \
    "${cfg[@]}" --workload nano="experiment=nano $no_extras"
  job $j-8b $((30 + 110 * r8)) python3 scripts/bench_matrix.py --out "$res/$j/8b" --rounds $r8 --timeout 65 \
    "${cfg[@]}" --workload 8b="experiment=nano model.preset=qwen3-8b bench.num_requests=128 $no_extras"
  job $j-b1 $((20 + 40 * r1)) python3 scripts/bench_matrix.py --out "$res/$j/b1" --rounds $r1 --timeout 45 \
    "${cfg[@]}" --workload b1="experiment=nano bench.num_requests=1 $no_extras"
}
run_pieces() {  # tag, name of the pieces array: one pytest job per piece, then the summary of exactly those files
  local tag=$1; local -n pieces=$2; local xml="$res/$1/junit" expect=""
  mkdir -p "$xml"; rm -f "$xml"/*.xml
  for piece in "${pieces[@]}"; do
    read -r name limit files <<< "$piece"
    expect="$expect $files"
    job "$tag-$name" "$limit" python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$xml/$name.xml" \
      $(printf 'tests/gpu/%s ' $files)
  done
  job $tag-summary 30 python3 scripts/gpu_tests_summary.py "$xml" --expect $expect
  cp "$res/$tag-summary/log.txt" "$out/${tag}_summary.txt"
}
gpu_tests_all() { run_pieces gpu_tests_all GPU_PIECES; }
for j in "$@"; do
  case $j in
    gpu_tests_all) gpu_tests_all ;;
    gpu_tests_more) run_pieces gpu_tests_more GPU_PIECES_MORE ;;
    # Per-layer projections and the LM head at M = 1/2/4/8, GEMV vs today's path (table, JSON, plot), then the
    # batch-1 decode profile with the GEMVs on (kernels per step, device time per step; today 289 and ~1.4 ms).
    smallbatch) job $j-kernels 200 python3 scripts/bench_small_batch.py --out "$res/smallbatch/kernels" &&
        job $j-profile-b1 90 python3 scripts/profile_decode.py --batch 1 --steps 200 --small-batch-kernels on \
        --out "$res/smallbatch/profile-b1-on" ;;
    # Programmatic dependent launch (model.programmatic_launch; docs/kernels.md): the GPU tests (each PDL kernel and a
    # graph-captured chain equal to the plain ones bit for bit, engine tokens on == off; look for: all passed, none
    # skipped), then scripts/bench_pdl.py (one layer, the LM head, the 28-layer stack, PDL off/on with and without the
    # GEMV's weight-first tile: look at `us` and `vs off` of on vs off, and off vs off_noprefetch: the new GEMV
    # without PDL must not be slower; bits = off must be True), then the batch-1 decode profile with the switch off
    # and on (device ms per step; today ~1.1 ms).
    pdl) job $j-tests 120 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_pdl_gpu.py
        job $j-bench 80 python3 scripts/bench_pdl.py --out "$res/pdl/bench"
        for p in off on; do job $j-profile-$p 90 python3 scripts/profile_decode.py --batch 1 --steps 200 \
          --full-step-graphs --small-batch-kernels auto --programmatic-launch $p --out "$res/pdl/profile-b1-$p"; done ;;
    # Decode profiles with full-step graphs on (kernels per step, launches outside graphs, host ms per step) at batch 1
    # and 256, and batch 256 with them off.
    fullgraph-profile) job $j-b1 90 python3 scripts/profile_decode.py --batch 1 --steps 200 --full-step-graphs \
          --out "$res/$j/b1" &&
        job $j-b256 150 python3 scripts/profile_decode.py --batch 256 --full-step-graphs --out "$res/$j/b256" &&
        job $j-b256-off 150 python3 scripts/profile_decode.py --batch 256 --out "$res/$j/b256-off" ;;
    # The small-batch GEMV's launch shapes swept at the 0.6B and 8B shapes, M = 1 and 8 (scripts/bench_gemv_tiles.py).
    gemv_tiles) job $j 270 python3 scripts/bench_gemv_tiles.py --out "$res/$j" --tokens 1 8 --kernels gemv ;;
    # The tensor-core dot kernel's candidate shapes (unmeasured rules) against cuBLAS and the defaults, 0.6B shapes
    # first (the 8B ones if time is left), M = 2 and 8: decides whether small_batch_max_tokens can go above 1.
    gemv_dot_tiles) job $j 540 python3 scripts/bench_gemv_tiles.py --out "$res/$j" --tokens 2 8 --kernels dot ;;
    # q/k norm + RoPE + store: its two grids at T from 1 to 8,192 (where ONE_HEAD_TOKENS belongs).
    qk_grids) job $j 90 python3 scripts/bench_layer_ops.py --tokens 1 --qk-grids 1 8 16 32 64 128 256 1024 8192 \
        --out "$res/$j/layer_ops.json" ;;
    # One run of the Qwen3-8B geometry, 128 nano requests (issue 25's target: >= 8,500 out tok/s).
    nano8b) job $j 200 python3 -m framework.entrypoints.cli bench experiment=nano model.preset=qwen3-8b bench.num_requests=128 \
        bench.baselines=[] bench.decode_idle_batch=0 bench.output_dir="$res/$j" ;;
    # The general full-step variant (logprobs inside the graph): every request asks for 5 top logprobs, batch 256,
    # full-step graphs on vs off. Look for: "full-step graphs: N steps replayed whole" with fallbacks only
    # "not pure decode", and the on run's device/host ms per step vs off (the general variant's cost, docs/architecture.md).
    fullgraph-profile-logprobs) job $j-b256-on 150 python3 scripts/profile_decode.py --batch 256 --logprobs 5 \
          --full-step-graphs --out "$res/$j/b256-on" &&
        job $j-b256-off 150 python3 scripts/profile_decode.py --batch 256 --logprobs 5 --out "$res/$j/b256-off" ;;
    # The driver's per-step command (gloo on the host CPU, typed msgpack vs the old pickle) at 64 and 256 rows.
    parallel_commands) job $j 120 bash -c "python3 scripts/bench_parallel_commands.py --rows 64 --iters 1000 &&
        python3 scripts/bench_parallel_commands.py --rows 256 --iters 1000" ;;
    parallel) job $j 330 python3 scripts/bench_parallel.py --out "$res/parallel" --cases 0.6b-tp1 0.6b-tp2 8b-tp1 8b-tp2 \
        0.6b-pp2 --num-requests-8b 128 --timeout 110 ;;
    # Issue 29's runs on several GPUs: PP=2 on its own (eager, slower; fewer requests so it ends in time), TP=4
    # (nvidia-h200-x4), and the server at TP=2.
    parallel_pp) job $j 330 python3 scripts/bench_parallel.py --out "$res/parallel_pp" --cases 0.6b-tp1 0.6b-pp2 \
        8b-pp2 --num-requests 128 --num-requests-8b 64 --timeout 150 ;;
    parallel_tp4) job $j 330 python3 scripts/bench_parallel.py --out "$res/parallel_tp4" --cases 8b-tp1 8b-tp2 8b-tp4 \
        --num-requests-8b 128 --timeout 140 ;;
    serve_tp2) job $j 420 python3 -m framework.entrypoints.cli bench experiment=serve_nano parallel.tensor_parallel_size=2 \
        bench.output_dir="$res/serve_tp2" ;;
    serve) job $j 420 python3 -m framework.entrypoints.cli bench experiment=serve_nano bench.output_dir="$res/serve" ;;
    nano) job $j 330 python3 -m framework.entrypoints.cli bench experiment=nano bench.output_dir="$res/nano" ;;
    # The V1 runner on the same requests (decode graphs, fused sampler; docs/runners.md): target >= 13,500 out tok/s.
    # Runner pairs and repeats without the HF baseline: give each run its own suffix (v2_nano-a v1_nano-a ...).
    v1_nano*) job $j 300 python3 -m framework.entrypoints.cli bench experiment=nano runner=v1 bench.baselines=[] \
        bench.decode_idle_batch=0 bench.output_dir="$res/$j" ;;
    v2_nano*) job $j 300 python3 -m framework.entrypoints.cli bench experiment=nano bench.baselines=[] \
        bench.decode_idle_batch=0 bench.output_dir="$res/$j" ;;
    hybrid_fast*) job $j 110 python3 -m framework.entrypoints.cli bench experiment=hybrid bench.baselines=[] bench.output_dir="$res/$j" ;;
    whisper_fast*) job $j 90 python3 scripts/bench_whisper.py --geometry base --out "$res/$j" ;;
    sampler) job $j 80 python3 scripts/bench_sampler.py "$res/sampler" ;;
    embed) job $j 90 python3 -m framework.entrypoints.cli bench experiment=embed_bench model=qwen3-0.6b bench.num_requests=1024 \
        'bench.input_len=[100,1024]' bench.hf_batch_size=32 scheduler.max_num_seqs=256 \
        scheduler.max_num_batched_tokens=16384 model.max_model_len=1040 bench.output_dir="$res/embed" ;;
    eval_tiny) job $j 100 python3 scripts/eval_tiny.py --skip-simulated --ks 1,3,5 --out "$res/eval_tiny" ;;
    hybrid) job $j 110 python3 -m framework.entrypoints.cli bench experiment=hybrid bench.output_dir="$res/hybrid" ;;
    whisper) job $j 90 python3 scripts/bench_whisper.py --geometry base --out "$res/whisper" ;;
    prefix) job $j 120 python3 -m framework.entrypoints.cli bench experiment=prefix_bench bench.output_dir="$res/prefix" ;;
    # Prefill attention (docs/kernels.md "Prefill attention"): the variant sweep against the older large-row launch
    # (< 240 s).
    prefill_sweep) job $j 235 python3 scripts/bench_prefill_attention.py "$res/$j" ;;
    prefix-hybrid) job $j 200 python3 -m framework.entrypoints.cli bench experiment=prefix_bench_hybrid bench.output_dir="$res/prefix_hybrid" ;;
    profile) job $j 150 python3 scripts/profile_decode.py --batch 256 --profile-prefill --out "$res/profile/b256" &&
        job profile-b1 60 python3 scripts/profile_decode.py --batch 1 --steps 200 --out "$res/profile/b1" &&
        job profile-k0 100 python3 scripts/profile_decode.py --batch 256 --spec-k 0 --out "$res/profile/k0" &&
        for r in 1 2 3; do  # the idle probe at batch 256 (issue 25: < 5 % in every one of 3 runs), one process each
            job profile-idle$r 120 python3 -m framework.entrypoints.cli bench experiment=nano bench.num_requests=1 \
                bench.baselines=[] bench.decode_idle_batch=256 bench.output_dir="$res/profile/idle$r"; done ;;
    layer_ops) job $j 90 python3 scripts/bench_layer_ops.py --out "$res/layer_ops/layer_ops.json" ;;
    profile-spec) for b in 1 16; do for k in 0 1 3 5 5,3; do job $j-b$b-k$k 80 python3 scripts/profile_decode.py --batch $b \
        --prompt-len 128 --steps 40 --temperature 0 --repeat-prompt --spec-k $k --out "$res/profile_spec/b$b-k$k"; done; done ;;
    sampler-variants) for w in 8 32; do job $j-w$w 80 python3 scripts/bench_sampler.py "$res/sampler_w$w" \
        --plan-warps $w; done ;;
    spec-quick) job $j 160 python3 scripts/bench_spec.py --repeats 2 --out "$res/spec" ;;
    spec-greedy) job $j 120 python3 scripts/bench_spec.py --repeats 2 --workloads greedy-repeat --batch-sizes 64 256 --out "$res/spec_greedy" ;;
    policy_host) job $j 60 python3 scripts/bench_policy_host.py --out "$res/$j" ;;
    # Host-side step work on the H200 machine's CPU: the engine's bookkeeping with a fake runner (scheduler, output
    # processing; ~30 s), then the runners' host overhead with the model stubbed (V2 and V1, 64/256/1024 rows).
    # The 256-row bookkeeping is run 3 times more on its own (one process each) for its run-to-run spread.
    host) job $j-bookkeeping 90 python3 scripts/bench_step_bookkeeping.py --sizes 64 256 1024 --out "$res/$j/bookkeeping" &&
        for r in 1 2 3; do job $j-b256-$r 40 python3 scripts/bench_step_bookkeeping.py --sizes 256 --repeats 1 \
            --out "$res/$j/b256-$r"; done &&
        job $j-overhead 200 python3 scripts/bench_host_overhead.py --device cuda --sizes 64 256 1024 --steps 20 \
        --out "$res/$j/overhead" ;;
    spec) job $j 330 python3 scripts/bench_spec.py --out "$res/spec" ;;
    # The dynamic-k goals (docs/benchmarks.md): pair rounds end early enough (--budget-s) for the run to fit its limit.
    spec_pairs) job $j 570 python3 scripts/bench_spec.py --repeats 3 --pairs 24 --fast-pairs 8 --budget-s 500 \
        --out "$res/spec" ;;
    spec5) job $j 500 python3 scripts/bench_spec.py --repeats 5 --out "$res/spec" ;;
    # Structured outputs: the bitmask kernel at real shapes and the engine on the device, then nano with half the
    # requests JSON-schema constrained vs none (step time overhead, goal <= 10%; constrained runs at min(8, CPUs), 2
    # and 0 fill threads; host fill p50 and its exposed part per step), then the fill without a model (LLExecutor
    # vs fill threads 0-8). Needs the llguidance and jsonschema wheels in .device-wheels/.
    structured) job $j 260 bash -c 'python3 -m pytest -q tests/gpu/test_structured_gpu.py; rc=$?
        python3 scripts/bench_structured.py --out "$1" || rc=1; exit $rc' _ "$res/structured" ;;
    # MoE (<= 320 s): fused-MoE / routing / alignment kernels vs references at Qwen3-30B-A3B shapes + engine parity;
    # kernel GB/s and TFLOP/s at 1/16/64/256/8192 tokens; the 128-request nano-style run on the Qwen3-30B-A3B
    # geometry (random bf16 weights, 61 GB).
    moe) job moe-tests 90 python3 -m pytest -q tests/gpu/test_fused_moe_gpu.py
        job moe-kernel 50 python3 scripts/bench_fused_moe.py --out "$res/moe/kernel"
        job moe-nano 180 python3 -m framework.entrypoints.cli bench experiment=moe bench.output_dir="$res/moe/nano" ;;
    # Issue 25's targets with the defaults: nano, the Qwen3-8B geometry (128 requests) and batch 1, one round each
    # (`paired_targets`); three calls give the median of three. `targets_fp8` pairs them with the FP8 KV cache.
    targets) job $j-host 20 python3 scripts/host_speed.py;
        paired_targets $j 1 1 1 now= ;;
    targets_fp8) job $j-host 20 python3 scripts/host_speed.py;
        paired_targets $j 1 1 1 bf16= fp8=cache.kv_cache_dtype=fp8 ;;
    # Where nano's and the 8B geometry's device time goes, by kind of step (bench.step_timeline), a probe before each.
    timeline) job $j-probe 20 python3 scripts/host_speed.py;
        job $j-nano 150 python3 -m framework.entrypoints.cli bench experiment=nano bench.baselines=[] bench.decode_idle_batch=0 \
          bench.step_timeline=true bench.output_dir="$res/$j/nano";
        job $j-probe2 20 python3 scripts/host_speed.py;
        job $j-8b 220 python3 -m framework.entrypoints.cli bench experiment=nano model.preset=qwen3-8b bench.num_requests=128 \
          bench.baselines=[] bench.decode_idle_batch=0 bench.step_timeline=true bench.output_dir="$res/$j/8b" ;;
    # The kernels of a large decode step: nano's batch 256 and the 8B geometry's batch 128 (scripts/profile_decode.py).
    profile_large) job $j-b256 150 python3 scripts/profile_decode.py --batch 256 --steps 40 --prompt-len 700 \
          --full-step-graphs --out "$res/$j/b256";
        job $j-8b-b128 200 python3 scripts/profile_decode.py --preset qwen3-8b --batch 128 --steps 20 \
          --prompt-len 600 --full-step-graphs --out "$res/$j/8b-b128" ;;
    # What each kernel kind costs inside the batch-1 chain (28 layers + head, PDL on; scripts/bench_pdl.py --ablate)
    # at the b1 workload's context lengths.
    b1_chain) for n in 1000 1400 1900; do job $j-$n 80 python3 scripts/bench_pdl.py --ablate --seq-len $n \
          --out "$res/$j/$n"; done ;;
    # Decode attention per launch: tile configs at nano's draining batches, then bf16 against FP8 caches.
    attention_sweeps) job $j-host 20 python3 scripts/host_speed.py;
        job $j-mixed 200 python3 scripts/bench_attention.py "$res/$j/mixed" --sweep-mixed;
        job $j-kv 300 python3 scripts/bench_attention.py "$res/$j/kv" --sweep-kv-dtype ;;
    *) echo "unknown job $j" | tee -a "$out/summary.log" ;;
  esac
done
