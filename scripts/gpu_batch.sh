#!/usr/bin/env bash
# One device call running several GPU jobs in turn, each under its own time limit; results packed into one
# archive after every job (a device call returns at most 8 files): OUT/results.tgz, OUT/summary.log.
#   scripts/gpu_batch.sh OUT_DIR JOB...      jobs: see the case list below
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
  "spec 110 test_spec_gpu.py test_draft_heads_gpu.py"
  "engine 80 test_gpu_engine.py test_prefix_caching_gpu.py"
  "hybrid_whisper 110 test_whisper_gpu.py test_mamba_gpu.py"
  "parallel 50 test_parallel_gpu.py"
  "structured 40 test_structured_gpu.py"
  "moe 90 test_fused_moe_gpu.py"
)
# Pieces that no longer fit GPU_PIECES' one device call: `gpu_tests_more` runs them the same way (its own call,
# at most 580 s too). Every tests/gpu file is in exactly one of the two lists (tests/test_ci_checks.py).
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
    # The small-batch GEMV kernels (docs/kernels.md): real 0.6B / 8B shapes vs cuBLAS vs float32, and an engine
    # with model.small_batch_kernels=on against HF. Look for: all passed.
    gpu_tests_smallbatch) job $j 160 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_small_batch_gpu.py ;;
    # Per-layer projections and the LM head at M = 1/2/4/8, GEMV vs today's path (table, JSON, plot), then the
    # batch-1 decode profile with the GEMVs on (kernels per step, device time per step; today 289 and ~1.4 ms).
    smallbatch) job $j-kernels 200 python3 scripts/bench_small_batch.py --out "$res/smallbatch/kernels" &&
        job $j-profile-b1 90 python3 scripts/profile_decode.py --batch 1 --steps 200 --small-batch-kernels on \
        --out "$res/smallbatch/profile-b1-on" ;;
    # One nano request (batch 1 decode), the key off and on, paired, 3 rounds (target >= 1,500 out tok/s; 607 off).
    smallbatch_nano) for r in 1 2 3; do for k in off on; do job $j-$k-r$r 95 python3 -m framework.cli bench \
        experiment=nano bench.num_requests=1 bench.baselines=[] bench.decode_idle_batch=0 model.small_batch_kernels=$k \
        bench.output_dir="$res/smallbatch_nano/$k-r$r"; done; done ;;
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
    # Full-step graphs (runner.full_step_cuda_graphs): on == off at real shapes, no host sync (alias of its piece).
    gpu_tests_fullgraph) job $j 120 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_full_step_graphs_gpu.py ;;
    # Full-step graphs (runner.full_step_cuda_graphs) off vs on, paired: one round per device call (<= 480 s), the order
    # flipped in round 2; run fullgraph-r1 fullgraph-r2 fullgraph-r3, then fullgraph-profile (decode profile with them
    # on: kernels per step, launches outside graphs, host ms per step, at batch 1 and 256).
    fullgraph-r*) order="false true"; [ "$j" = fullgraph-r2 ] && order="true false"
        for fs in $order; do
          job $j-nano-fs_$fs 150 python3 -m framework.cli bench experiment=nano bench.baselines=[] \
            bench.decode_idle_batch=0 runner.full_step_cuda_graphs=$fs bench.output_dir="$res/$j/nano-fs_$fs"
          job $j-b1-fs_$fs 90 python3 -m framework.cli bench experiment=nano bench.num_requests=1 bench.baselines=[] \
            bench.decode_idle_batch=0 runner.full_step_cuda_graphs=$fs bench.output_dir="$res/$j/b1-fs_$fs"
        done ;;
    fullgraph-profile) job $j-b1 90 python3 scripts/profile_decode.py --batch 1 --steps 200 --full-step-graphs \
          --out "$res/$j/b1" &&
        job $j-b256 150 python3 scripts/profile_decode.py --batch 256 --full-step-graphs --out "$res/$j/b256" &&
        job $j-b256-off 150 python3 scripts/profile_decode.py --batch 256 --out "$res/$j/b256-off" ;;
    # Issue 25's fast paths against each other, paired rounds (scripts/bench_matrix.py: rotated order, host probe per
    # run, median and within-round ratio): nano and batch 1 (targets 28,000 and 1,500 out tok/s), then Qwen3-8B.
    issue25_matrix) job $j 590 python3 scripts/bench_matrix.py --out "$res/$j" --rounds 3 --timeout 120 \
        --config default= --config full_step=runner.full_step_cuda_graphs=true \
        --config small_batch=model.small_batch_kernels=on \
        --config both="runner.full_step_cuda_graphs=true model.small_batch_kernels=on" \
        --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0" \
        --workload b1="experiment=nano bench.num_requests=1 bench.baselines=[] bench.decode_idle_batch=0" ;;
    # Full-step graphs alone against the default (both at nano and batch 1): the one-call version of fullgraph-r1..3.
    issue25_fullstep) job $j 590 python3 scripts/bench_matrix.py --out "$res/$j" --rounds 3 --timeout 120 \
        --config default= --config full_step=runner.full_step_cuda_graphs=true \
        --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0" \
        --workload b1="experiment=nano bench.num_requests=1 bench.baselines=[] bench.decode_idle_batch=0" ;;
    # The small-batch GEMV's launch shapes swept at the 0.6B and 8B shapes, M = 1 and 8 (scripts/bench_gemv_tiles.py).
    gemv_tiles) job $j 270 python3 scripts/bench_gemv_tiles.py --out "$res/$j" --tokens 1 8 --kernels gemv ;;
    # The tensor-core dot kernel's candidate shapes (unmeasured rules) against cuBLAS and the defaults, 0.6B shapes
    # first (the 8B ones if time is left), M = 2 and 8: decides whether small_batch_max_tokens can go above 1.
    gemv_dot_tiles) job $j 540 python3 scripts/bench_gemv_tiles.py --out "$res/$j" --tokens 2 8 --kernels dot ;;
    # Full-step graphs with and without the small-batch GEMVs, paired (batch 1 and nano; the GEMVs serve <= 8 rows).
    issue25_gemv) job $j 590 python3 scripts/bench_matrix.py --out "$res/$j" --rounds ${ROUNDS:-3} --timeout 120 \
        --config full_step=runner.full_step_cuda_graphs=true \
        --config full_step+small_batch="runner.full_step_cuda_graphs=true model.small_batch_kernels=on" \
        --workload b1="experiment=nano bench.num_requests=1 bench.baselines=[] bench.decode_idle_batch=0" \
        --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0" ;;
    # The defaults before issue 25's measurements (both fast paths off) against today's (full-step graphs on,
    # small-batch GEMVs at one row), paired, at batch 1 and nano.
    issue25_defaults) job $j 590 python3 scripts/bench_matrix.py --out "$res/$j" --rounds ${ROUNDS:-3} --timeout 120 \
        --config before="runner.full_step_cuda_graphs=false model.small_batch_kernels=off" --config now= \
        --workload b1="experiment=nano bench.num_requests=1 bench.baselines=[] bench.decode_idle_batch=0" \
        --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0" ;;
    # What the next kernels of issue 25 aim at: the batch-1 step's kernels with today's defaults, decode attention
    # tiles at nano's shapes (contexts 640-1,900, batch 256 down to 1), the dot kernel at 0.6B shapes, M = 2 and 8.
    issue25_probe) job $j-b1 90 python3 scripts/profile_decode.py --batch 1 --steps 200 --full-step-graphs \
          --small-batch-kernels auto --out "$res/$j/b1";
        job $j-attn 240 python3 scripts/bench_attention.py "$res/$j/attn" --sweep-nano;
        job $j-dot 230 python3 scripts/bench_gemv_tiles.py --out "$res/$j/dot" --geometries qwen3-0.6b --tokens 2 8 \
          --kernels dot ;;
    # Split-KV decode with the reduce fused into the attention launch, and the decode tiles rule at nano's shapes:
    # the GPU tests of both (fused == reference == two-launch, counters zero after, CUDA graph replayed with new
    # seq_lens, stale-counter negative control; look for: all passed), then bench_attention --compare-reduce:
    # table 1, batch 1/4/16 x 1024-4096, "fused us" < "2-launch us" wherever splits > 1 (~4 us per call at batch 1:
    # "saved/step us" ~100), max diff ~0, counters 0 True; table 2, "rule us" < "128/4/2 us" at batch >= 64.
    attn_fused) job $j-tests 120 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_attention_gpu.py \
          -k "fused_reduce or every_split or cuda_graph or decode_qwen3";
        job $j-bench 75 python3 scripts/bench_attention.py "$res/$j/bench" --compare-reduce ;;
    # The same end to end: the batch-1 decode profile as issue25_probe-b1 ran it (there: 221.2 kernels per step,
    # 0.952 kernel ms per step, _split_kv_reduce_kernel 4.3 us x 28; expect 193.2 and no reduce kernel), then nano.
    attn_fused_e2e) job $j-b1 90 python3 scripts/profile_decode.py --batch 1 --steps 200 --full-step-graphs \
          --small-batch-kernels auto --out "$res/$j/b1";
        job $j-nano 150 python3 -m framework.cli bench experiment=nano bench.baselines=[] bench.decode_idle_batch=0 \
          bench.output_dir="$res/$j/nano" ;;
    # This session's new defaults checked and measured in one call: the PDL, attention (fused split-KV merge, decode
    # tiles) and prefill-kernel GPU tests, then PDL off vs on (the defaults) at batch 1 (2 rounds), prefix_bench with the new prefill kernel
    # (default) and the older launch (that run's environment switch left the code later: see git at ff6d1b8), and
    # PDL off vs on at nano (1 round).
    s11_final) job $j-pdl-tests 80 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_pdl_gpu.py;
        job $j-attn-tests 80 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_attention_gpu.py;
        job $j-prefill-tests 130 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_prefill_attention_gpu.py;
        job $j-b1 130 python3 scripts/bench_matrix.py --out "$res/$j/b1" --rounds 2 --timeout 60 \
          --config pdl_off=model.programmatic_launch=off --config now= \
          --workload b1="experiment=nano bench.num_requests=1 bench.baselines=[] bench.decode_idle_batch=0";
        job $j-prefix 40 python3 -m framework.cli bench experiment=prefix_bench bench.output_dir="$res/$j/prefix";
        job $j-nano 210 python3 scripts/bench_matrix.py --out "$res/$j/nano" --rounds 1 --timeout 100 \
          --config pdl_off=model.programmatic_launch=off --config now= \
          --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0" ;;
    # Session 12's first call (2026-12-02), what of it still runs: the batch-1 decode profile (kernels and device ms
    # per step) and the prefill steps of prefix_bench's shapes under the profiler (kernel table; 2,040-token prompts
    # at batch 256, 8,192 tokens per step). It also ran the fused-rope decode attention (GPU tests, batch 1 paired
    # against today's defaults, profile) and the block-id prefetch sweep: both options left the tree after it
    # (results in docs/benchmarks.md).
    s12_probe) job $j-profile-b1 60 python3 scripts/profile_decode.py --batch 1 --steps 200 --full-step-graphs \
          --small-batch-kernels auto --out "$res/$j/profile-b1";
        job $j-prefill 120 python3 scripts/profile_decode.py --batch 256 --prompt-len 2040 --max-model-len 2304 \
          --steps 10 --profile-prefill --out "$res/$j/prefill" ;;
    # The q/k norm + RoPE + KV store kernel retiled (a program per BLOCK_T tokens x heads; was one per token and
    # head): its GPU tests, bench_layer_ops at T = 1 / 256 / 8,192 (before: 6.1 / 9.2 us graph, ~112 us in a
    # prefill step), the prefill profile again, prefix_bench 3 times, then the small-batch and full-step GPU files.
    s12_rope) job $j-tests 80 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_layer_ops_gpu.py;
        job $j-bench 80 python3 scripts/bench_layer_ops.py --tokens 1 256 8192 --out "$res/$j/layer_ops.json";
        job $j-prefill 90 python3 scripts/profile_decode.py --batch 256 --prompt-len 2040 --max-model-len 2304 \
          --steps 10 --profile-prefill --out "$res/$j/prefill";
        for r in 1 2 3; do job $j-prefix$r 60 bash -c "python3 scripts/host_speed.py; python3 -m framework.cli bench \
          experiment=prefix_bench bench.output_dir=$res/$j/prefix$r"; done;
        job $j-smallbatch 160 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_small_batch_gpu.py;
        job $j-fullgraph 120 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_full_step_graphs_gpu.py ;;
    # q/k norm + RoPE + store: its two grids at T from 1 to 8,192 (where ONE_HEAD_TOKENS belongs).
    qk_grids) job $j 90 python3 scripts/bench_layer_ops.py --tokens 1 --qk-grids 1 8 16 32 64 128 256 1024 8192 \
        --out "$res/$j/layer_ops.json" ;;
    # One run of the Qwen3-8B geometry, 128 nano requests (issue 25's target: >= 8,500 out tok/s).
    nano8b) job $j 200 python3 -m framework.cli bench experiment=nano model.preset=qwen3-8b bench.num_requests=128 \
        bench.baselines=[] bench.decode_idle_batch=0 bench.output_dir="$res/$j" ;;
    # Session 12's last call: the draft-head GPU file alone (it ran past the spec piece's 80 s; stacks dumped if
    # it hangs), then the GPU files of the kernels the cleanup touched (attention, PDL, prefill), and structured.
    s12_final) job $j-draft 240 python3 -m pytest -q -rs -p no:cacheprovider -o faulthandler_timeout=200 \
          --durations=0 tests/gpu/test_draft_heads_gpu.py;
        job $j-attention 80 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_attention_gpu.py;
        job $j-pdl 80 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_pdl_gpu.py;
        job $j-prefill 100 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_prefill_attention_gpu.py;
        job $j-structured 60 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_structured_gpu.py ;;
    # Why prefix_bench's off row follows the host's speed (171-173K fast, 144K half speed): the prefill steps' host
    # phases (wall and CPU ms per step: schedule, execute_model, sample_tokens, wait_output, ...) and kernel table
    # at prefix_bench's shapes, 3 times, each between two host probes. Look at execute_model + sample_tokens
    # (host) against step_wall: the host is exposed where they come close.
    prefill_phases) for r in 1 2 3; do job $j-r$r 120 bash -c "python3 scripts/host_speed.py; python3 scripts/profile_decode.py --batch 256 --prompt-len 2040 \
          --max-model-len 2304 --steps 10 --profile-prefill --out $res/$j/r$r; python3 scripts/host_speed.py"; done ;;
    issue25_8b) job $j 590 python3 scripts/bench_matrix.py --out "$res/$j" --rounds 3 --timeout 180 \
        --config default= --config both="runner.full_step_cuda_graphs=true model.small_batch_kernels=on" \
        --workload 8b="experiment=nano model.preset=qwen3-8b bench.num_requests=128 bench.baselines=[] bench.decode_idle_batch=0" ;;
    # Both issue 25 fast paths on (full-step graphs + small-batch GEMVs): kernels per step, launches outside graphs,
    # device and host ms per step at batch 1 and 256 (compare with job profile's b1 / b256, both off).
    issue25_profiles) job $j-b1 90 python3 scripts/profile_decode.py --batch 1 --steps 200 --full-step-graphs \
          --small-batch-kernels on --out "$res/$j/b1" &&
        job $j-b256 150 python3 scripts/profile_decode.py --batch 256 --full-step-graphs --small-batch-kernels on \
          --out "$res/$j/b256" ;;
    # The general full-step variant (logprobs inside the graph): every request asks for 5 top logprobs, batch 256,
    # full-step graphs on vs off. Look for: "full-step graphs: N steps replayed whole" with fallbacks only
    # "not pure decode", and the on run's device/host ms per step vs off (the general variant's cost, docs/architecture.md).
    fullgraph-profile-logprobs) job $j-b256-on 150 python3 scripts/profile_decode.py --batch 256 --logprobs 5 \
          --full-step-graphs --out "$res/$j/b256-on" &&
        job $j-b256-off 150 python3 scripts/profile_decode.py --batch 256 --logprobs 5 --out "$res/$j/b256-off" ;;
    gpu_tests_parallel) job $j 120 python3 -m pytest -q -x tests/gpu/test_parallel_gpu.py ;;
    gpu_tests_single) job $j 130 python3 -m pytest -q tests/gpu/test_sampler_fused_gpu.py tests/gpu/test_spec_gpu.py ;;
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
    serve_tp2) job $j 420 python3 -m framework.cli bench experiment=serve_nano parallel.tensor_parallel_size=2 \
        bench.output_dir="$res/serve_tp2" ;;
    serve) job $j 420 python3 -m framework.cli bench experiment=serve_nano bench.output_dir="$res/serve" ;;
    nano) job $j 330 python3 -m framework.cli bench experiment=nano bench.output_dir="$res/nano" ;;
    # The V1 runner on the same requests (decode graphs, fused sampler; docs/runners.md): target >= 13,500 out tok/s.
    # Runner pairs and repeats without the HF baseline: give each run its own suffix (v2_nano-a v1_nano-a ...).
    v1_nano*) job $j 300 python3 -m framework.cli bench experiment=nano runner=v1 bench.baselines=[] \
        bench.decode_idle_batch=0 bench.output_dir="$res/$j" ;;
    v2_nano*) job $j 300 python3 -m framework.cli bench experiment=nano bench.baselines=[] \
        bench.decode_idle_batch=0 bench.output_dir="$res/$j" ;;
    hybrid_fast*) job $j 110 python3 -m framework.cli bench experiment=hybrid bench.baselines=[] bench.output_dir="$res/$j" ;;
    whisper_fast*) job $j 90 python3 scripts/bench_whisper.py --geometry base --out "$res/$j" ;;
    gpu_tests_engine) job $j 200 python3 -m pytest -q tests/gpu/test_sampler_gpu.py tests/gpu/test_gpu_engine.py \
        tests/gpu/test_draft_heads_gpu.py ;;
    sampler) job $j 80 python3 scripts/bench_sampler.py "$res/sampler" ;;
    embed) job $j 90 python3 -m framework.cli bench experiment=embed_bench model=qwen3-0.6b bench.num_requests=1024 \
        'bench.input_len=[100,1024]' bench.hf_batch_size=32 scheduler.max_num_seqs=256 \
        scheduler.max_num_batched_tokens=16384 model.max_model_len=1040 bench.output_dir="$res/embed" ;;
    eval_tiny) job $j 100 python3 scripts/eval_tiny.py --skip-simulated --ks 1,3,5 --out "$res/eval_tiny" ;;
    hybrid) job $j 110 python3 -m framework.cli bench experiment=hybrid bench.output_dir="$res/hybrid" ;;
    whisper) job $j 90 python3 scripts/bench_whisper.py --geometry base --out "$res/whisper" ;;
    prefix) job $j 120 python3 -m framework.cli bench experiment=prefix_bench bench.output_dir="$res/prefix" ;;
    # Prefill attention (docs/kernels.md "Prefill attention"): the variant sweep against the older large-row launch
    # (< 240 s).
    prefill_sweep) job $j 235 python3 scripts/bench_prefill_attention.py "$res/$j" ;;
    prefix-hybrid) job $j 200 python3 -m framework.cli bench experiment=prefix_bench_hybrid bench.output_dir="$res/prefix_hybrid" ;;
    profile) job $j 150 python3 scripts/profile_decode.py --batch 256 --profile-prefill --out "$res/profile/b256" &&
        job profile-b1 60 python3 scripts/profile_decode.py --batch 1 --steps 200 --out "$res/profile/b1" &&
        job profile-k0 100 python3 scripts/profile_decode.py --batch 256 --spec-k 0 --out "$res/profile/k0" &&
        for r in 1 2 3; do  # the idle probe at batch 256 (issue 25: < 5 % in every one of 3 runs), one process each
            job profile-idle$r 120 python3 -m framework.cli bench experiment=nano bench.num_requests=1 \
                bench.baselines=[] bench.decode_idle_batch=256 bench.output_dir="$res/profile/idle$r"; done ;;
    gpu_tests_new) job $j 200 python3 -m pytest -q tests/gpu/test_layer_ops_gpu.py tests/gpu/test_random_weights_gpu.py \
        tests/gpu/test_sampler_fused_gpu.py tests/gpu/test_sampler_gpu.py tests/gpu/test_spec_gpu.py ;;
    layer_ops) job $j 90 python3 scripts/bench_layer_ops.py --out "$res/layer_ops/layer_ops.json" ;;
    gpu_tests_rest) job $j 200 python3 -m pytest -q tests/gpu/test_whisper_gpu.py tests/gpu/test_mamba_gpu.py ;;
    profile-spec) for b in 1 16; do for k in 0 1 3 5 5,3; do job $j-b$b-k$k 80 python3 scripts/profile_decode.py --batch $b \
        --prompt-len 128 --steps 40 --temperature 0 --repeat-prompt --spec-k $k --out "$res/profile_spec/b$b-k$k"; done; done ;;
    sampler-variants) for w in 8 32; do job $j-w$w 80 python3 scripts/bench_sampler.py "$res/sampler_w$w" \
        --plan-warps $w; done ;;
    gpu_tests_sampler) job $j 170 python3 -m pytest -q tests/gpu/test_sampler_fused_gpu.py tests/gpu/test_sampler_gpu.py \
        tests/gpu/test_spec_gpu.py ;;
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
    gpu_tests_spec) job $j 120 python3 -m pytest -q tests/gpu/test_spec_gpu.py ;;
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
        job moe-nano 180 python3 -m framework.cli bench experiment=moe bench.output_dir="$res/moe/nano" ;;
    # Session 13's first look: the GPU tests of commits never run on a GPU (layer ops warm-up / q-k RoPE switch,
    # prefill and decode attention), the batch-1..8 split sweep (splits up to 32), and the batch-1 step profile at
    # the b1 workload's contexts (1,400-token prompt).
    s13_probe) job $j-tests 200 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_layer_ops_gpu.py \
          tests/gpu/test_prefill_attention_gpu.py tests/gpu/test_attention_gpu.py;
        job $j-sweep 200 python3 scripts/bench_attention.py "$res/$j/sweep" --sweep-small;
        job $j-profile-b1 70 python3 scripts/profile_decode.py --batch 1 --steps 200 --prompt-len 1400 \
          --full-step-graphs --small-batch-kernels auto --out "$res/$j/profile-b1" ;;
    # What each kernel kind costs inside the batch-1 chain (28 layers + head, PDL on): scripts/bench_pdl.py --ablate
    # at the b1 workload's context lengths.
    s13_ablate) for n in 1000 1400 1900; do job $j-$n 80 python3 scripts/bench_pdl.py --ablate --seq-len $n \
          --out "$res/$j/$n"; done ;;
    # The unrolled split merge and one-tile KV splits (MIN_SPLIT_TOKENS 128): the PDL and attention GPU tests (PDL
    # chain bit for bit), the ablation at 1,000-4,096 keys, then b1 (3 rounds), nano (2 rounds) and the 8B geometry
    # (one run) with today's defaults, each run between two host-speed probes.
    s13_final) job $j-tests 150 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_pdl_gpu.py \
          tests/gpu/test_attention_gpu.py;
        for n in 1000 1400 1900 4096; do job $j-ablate-$n 60 python3 scripts/bench_pdl.py --ablate --seq-len $n \
          --out "$res/$j/ablate-$n"; done;
        job $j-b1 200 python3 scripts/bench_matrix.py --out "$res/$j/b1" --rounds 3 --timeout 90 --config now= \
          --workload b1="experiment=nano bench.num_requests=1 bench.baselines=[] bench.decode_idle_batch=0";
        job $j-nano 200 python3 scripts/bench_matrix.py --out "$res/$j/nano" --rounds 2 --timeout 95 --config now= \
          --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0";
        job $j-8b 200 python3 scripts/bench_matrix.py --out "$res/$j/8b" --rounds 1 --timeout 190 --config now= \
          --workload 8b="experiment=nano model.preset=qwen3-8b bench.num_requests=128 bench.baselines=[] bench.decode_idle_batch=0" ;;
    # Where nano's and the 8B geometry's device time goes, by kind of step (bench.step_timeline), probe before each.
    s14_timeline) job $j-probe 30 python3 scripts/host_speed.py;
        job $j-nano 150 python3 -m framework.cli bench experiment=nano bench.baselines=[] bench.decode_idle_batch=0 \
          bench.step_timeline=true bench.output_dir="$res/$j/nano";
        job $j-probe2 30 python3 scripts/host_speed.py;
        job $j-8b 220 python3 -m framework.cli bench experiment=nano model.preset=qwen3-8b bench.num_requests=128 \
          bench.baselines=[] bench.decode_idle_batch=0 bench.step_timeline=true bench.output_dir="$res/$j/8b" ;;
    # The kernels of a large-batch decode step (where nano's and the 8B geometry's time above the floor is).
    s14_profile) job $j-b256 150 python3 scripts/profile_decode.py --batch 256 --steps 40 --prompt-len 700 \
          --full-step-graphs --out "$res/$j/b256";
        job $j-8b-b128 200 python3 scripts/profile_decode.py --preset qwen3-8b --batch 128 --steps 20 \
          --prompt-len 600 --full-step-graphs --out "$res/$j/8b-b128" ;;
    # Decode attention started longest rows first (model.longest_rows_first): its GPU tests, the kernel at nano's
    # mixed lengths (bench_attention.py --row-order, twice), then nano and the 8B geometry, paired rounds on / off.
    s14_order) job $j-tests 150 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_attention_gpu.py;
        job $j-kernel 120 python3 scripts/bench_attention.py "$res/$j/kernel" --row-order;
        job $j-kernel2 120 python3 scripts/bench_attention.py "$res/$j/kernel2" --row-order;
        job $j-prefill 120 python3 scripts/profile_decode.py --batch 256 --prompt-len 560 --steps 10 \
          --profile-prefill --full-step-graphs --out "$res/$j/prefill" ;;
    s14_order_nano) job $j-tests 150 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_attention_gpu.py \
          -k "longest or decode_qwen3";
        job $j-kernel 120 python3 scripts/bench_attention.py "$res/$j/kernel" --row-order;
        job $j-nano 330 python3 scripts/bench_matrix.py --out "$res/$j/nano" --rounds 2 --timeout 80 --config order= \
          --config batch=model.longest_rows_first=false \
          --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0";
        job $j-8b 200 python3 scripts/bench_matrix.py --out "$res/$j/8b" --rounds 1 --timeout 95 --config order= \
          --config batch=model.longest_rows_first=false \
          --workload 8b="experiment=nano model.preset=qwen3-8b bench.num_requests=128 bench.baselines=[] bench.decode_idle_batch=0" ;;
    # After the change: the engine and full-step GPU tests (a 72-row test of the order), nano's timeline with the
    # order on, and a second paired round of the 8B geometry.
    s14_final) job $j-tests 200 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_gpu_engine.py \
          tests/gpu/test_full_step_graphs_gpu.py;
        job $j-probe 30 python3 scripts/host_speed.py;
        job $j-nano 150 python3 -m framework.cli bench experiment=nano bench.baselines=[] bench.decode_idle_batch=0 \
          bench.step_timeline=true bench.output_dir="$res/$j/nano";
        job $j-8b 200 python3 scripts/bench_matrix.py --out "$res/$j/8b" --rounds 1 --timeout 95 \
          --config batch=model.longest_rows_first=false --config order= \
          --workload 8b="experiment=nano model.preset=qwen3-8b bench.num_requests=128 bench.baselines=[] bench.decode_idle_batch=0" ;;
    # cuBLAS against cuBLASLt at the decode projections' shapes (32-256 rows), then the prefix-caching GPU tests.
    s14_proj) job $j-bench 70 python3 scripts/bench_projections.py "$res/$j/bench";
        job $j-tests 60 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_prefix_caching_gpu.py ;;
    # The logits stay bf16 into the fused sampler: its GPU tests and the full-step graphs', then nano paired
    # against the commit before (bench_base/: `git archive ad27184 ... | tar -x -C bench_base`, untracked).
    s15_bf16) job $j-tests 200 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_sampler_fused_gpu.py \
          tests/gpu/test_full_step_graphs_gpu.py;
        job $j-nano 340 python3 scripts/bench_matrix.py --out "$res/$j/nano" --rounds 2 --timeout 80 --config bf16= \
          --config fp32@bench_base= --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0" ;;
    # The sampler: the commit before (bench_base/, float32 logits, a block-wide non-finite count per block)
    # against today's kernels on float32 and bfloat16 logits, 4 and 8 warps; its GPU tests; a b256 profile.
    s15_sampler) rm -rf bench_base/scripts && cp -r scripts bench_base/scripts;
        job $j-base 90 bash -c "cd bench_base && PYTHONPATH=/tmp/site:\$PWD python3 scripts/bench_sampler.py $res/$j/base";
        job $j-fp32 90 python3 scripts/bench_sampler.py "$res/$j/fp32";
        job $j-bf16 90 python3 scripts/bench_sampler.py "$res/$j/bf16" --dtype bfloat16;
        job $j-bf16-w8 90 python3 scripts/bench_sampler.py "$res/$j/bf16-w8" --dtype bfloat16 --sample-warps 8;
        job $j-tests 100 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_sampler_fused_gpu.py;
        job $j-b256 90 python3 scripts/profile_decode.py --batch 256 --steps 20 --prompt-len 700 \
          --full-step-graphs --out "$res/$j/b256" ;;
    # The session's stop: the engine GPU tests on bf16 logits, then the issue's targets (nano and batch 1, three
    # rounds; the 8B geometry, two; the shared-prefix workload once), each run with its host probe.
    s15_final) job $j-tests 90 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_gpu_engine.py;
        job $j-nano 200 python3 scripts/bench_matrix.py --out "$res/$j/nano" --rounds 3 --timeout 60 --config now= \
          --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0" \
          --workload b1="experiment=nano bench.num_requests=1 bench.baselines=[] bench.decode_idle_batch=0";
        job $j-8b 130 python3 scripts/bench_matrix.py --out "$res/$j/8b" --rounds 2 --timeout 62 --config now= \
          --workload 8b="experiment=nano model.preset=qwen3-8b bench.num_requests=128 bench.baselines=[] bench.decode_idle_batch=0";
        job $j-prefix 110 python3 -m framework.cli bench experiment=prefix_bench bench.output_dir="$res/$j/prefix" ;;
    # After the bf16 logits: the speculative-decoding GPU tests (target logits reach verification in the model
    # dtype), the third run of the 8B geometry, and one run of nano with its batch-256 decode idle probe.
    s15_last) job $j-spec 110 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_spec_gpu.py \
          tests/gpu/test_draft_heads_gpu.py;
        job $j-8b 75 python3 scripts/bench_matrix.py --out "$res/$j/8b" --rounds 1 --timeout 70 --config now= \
          --workload 8b="experiment=nano model.preset=qwen3-8b bench.num_requests=128 bench.baselines=[] bench.decode_idle_batch=0";
        job $j-idle 55 python3 -m framework.cli bench experiment=nano bench.baselines=[] bench.output_dir="$res/$j/idle" ;;
    # Where the host's time goes in nano-sized prompt steps (cProfile of the engine thread, kernels beside it),
    # then the speculative-decoding and draft-head GPU tests that s15_last could not finish.
    s16_prefill) job $j-host 20 python3 scripts/host_speed.py;
        job $j-profile 150 python3 scripts/profile_decode.py --batch 256 --steps 10 --prompt-len 560 \
          --profile-prefill --full-step-graphs --out "$res/$j/profile";
        job $j-spec 150 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_spec_gpu.py \
          tests/gpu/test_draft_heads_gpu.py ;;
    # Prefill graph pieces (runner.prefill_cuda_graphs): their GPU tests and the prompt steps' profile with them (the
    # s16_prefill run is the one without). Its benchmarks failed on the Hydra configs then; s16_pieces2 ran them.
    s16_pieces) job $j-host 20 python3 scripts/host_speed.py;
        job $j-tests 150 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_prefill_graphs_gpu.py;
        job $j-profile 120 python3 scripts/profile_decode.py --batch 256 --steps 10 --prompt-len 560 \
          --profile-prefill --full-step-graphs --prefill-graphs --out "$res/$j/profile" ;;
    # Prefill graph pieces off / on: nano paired (3 rounds), the 8B geometry paired (1 round), prefix_bench with
    # them, and nano's batch-256 idle probe.
    s16_pieces2) job $j-nano 200 python3 scripts/bench_matrix.py --out "$res/$j/nano" --rounds 3 --timeout 60 --config off=runner.prefill_cuda_graphs=false \
          --config pieces=runner.prefill_cuda_graphs=true \
          --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0";
        job $j-8b 150 python3 scripts/bench_matrix.py --out "$res/$j/8b" --rounds 1 --timeout 75 --config off=runner.prefill_cuda_graphs=false \
          --config pieces=runner.prefill_cuda_graphs=true \
          --workload 8b="experiment=nano model.preset=qwen3-8b bench.num_requests=128 bench.baselines=[] bench.decode_idle_batch=0";
        job $j-prefix 100 python3 -m framework.cli bench experiment=prefix_bench runner.prefill_cuda_graphs=true \
          bench.output_dir="$res/$j/prefix";
        job $j-idle 60 python3 -m framework.cli bench experiment=nano bench.baselines=[] runner.prefill_cuda_graphs=true \
          bench.output_dir="$res/$j/idle" ;;
    # Eighth session: KV blocks head-major against token-major (a --compare-layout mode of bench_attention.py, not
    # kept: docs/benchmarks.md, "Issue 25, eighth session", gives its code), the ngram speculative tests with the
    # prefill pieces on by default, and one baseline round of nano and b1.
    s17_probe) job $j-host 20 python3 scripts/host_speed.py;
        job $j-layout 200 python3 scripts/bench_attention.py "$res/$j/layout" --compare-layout;
        job $j-spec 150 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_spec_gpu.py;
        job $j-nano 150 python3 scripts/bench_matrix.py --out "$res/$j/nano" --rounds 1 --timeout 60 --config now= \
          --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0" \
          --workload b1="experiment=nano bench.num_requests=1 bench.baselines=[] bench.decode_idle_batch=0" ;;
    # Decode tiles at nano's draining batches of mixed lengths, and nano's step timeline with today's defaults.
    s17_mixed) job $j-host 20 python3 scripts/host_speed.py;
        job $j-sweep 200 python3 scripts/bench_attention.py "$res/$j/sweep" --sweep-mixed;
        job $j-timeline 90 python3 -m framework.cli bench experiment=nano bench.baselines=[] bench.decode_idle_batch=0 \
          bench.step_timeline=true bench.output_dir="$res/$j/timeline" ;;
    # The balanced-tiles decode attention against the engine's launch (kernel and --balanced mode: in git at 33ccfda).
    s17_balanced) job $j-host 20 python3 scripts/host_speed.py;
        job $j-bench 300 python3 scripts/bench_attention.py "$res/$j/bench" --balanced ;;
    # model.programmatic_launch_large_batches (in git at 33ccfda): its GPU tests, nano paired off / on (3 rounds), the
    # 8B geometry (1 pair).
    s17_pdl) job $j-tests 110 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_pdl_gpu.py;
        job $j-nano 290 python3 scripts/bench_matrix.py --out "$res/$j/nano" --rounds 3 --timeout 60 \
          --config off=model.programmatic_launch_large_batches=false --config on=model.programmatic_launch_large_batches=true \
          --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0";
        job $j-8b 150 python3 scripts/bench_matrix.py --out "$res/$j/8b" --rounds 1 --timeout 70 \
          --config off=model.programmatic_launch_large_batches=false --config on=model.programmatic_launch_large_batches=true \
          --workload 8b="experiment=nano model.preset=qwen3-8b bench.num_requests=128 bench.baselines=[] bench.decode_idle_batch=0" ;;
    # The targets at the eighth session's stop (engine code as at 5ae6ded): b1 x 3, the 8B geometry x 2, prefix_bench,
    # and nano's batch-256 idle probe.
    s17_final) job $j-b1 120 python3 scripts/bench_matrix.py --out "$res/$j/b1" --rounds 3 --timeout 35 --config now= \
          --workload b1="experiment=nano bench.num_requests=1 bench.baselines=[] bench.decode_idle_batch=0";
        job $j-8b 130 python3 scripts/bench_matrix.py --out "$res/$j/8b" --rounds 2 --timeout 62 --config now= \
          --workload 8b="experiment=nano model.preset=qwen3-8b bench.num_requests=128 bench.baselines=[] bench.decode_idle_batch=0";
        job $j-prefix 110 python3 -m framework.cli bench experiment=prefix_bench bench.output_dir="$res/$j/prefix";
        job $j-idle 70 python3 -m framework.cli bench experiment=nano bench.baselines=[] bench.output_dir="$res/$j/idle" ;;
    # The TMA GEMM (framework/kernels/triton_tma_gemm.py, in git at ae5350a): its tests on the GPU, then the sweep
    # against cuBLAS at the 8B geometry's and the 0.6B's decode projection shapes.
    s18_tma) job $j-tests 90 python3 -m pytest -q -rs -p no:cacheprovider tests/test_tma_gemm.py;
        job $j-bench 420 python3 scripts/bench_tma_gemm.py "$res/$j/bench" ;;
    # cuBLAS's layouts: F.linear ([N, K] weights, a TN product) against `x @ w` ([K, N], NN), default BLAS and
    # cuBLASLt, at the decode shapes and the 8B's prefill (8,192 rows); then again with 64 MiB BLAS workspaces.
    s18_layout) job $j-decode 150 python3 scripts/bench_projections.py "$res/$j/decode" --rows 64 128 256;
        job $j-prefill 120 python3 scripts/bench_projections.py "$res/$j/prefill" --rows 8192 \
          --shapes "8b qkv" "8b o" "8b gate_up" "8b down";
        job $j-workspace 150 env CUBLASLT_WORKSPACE_SIZE=65536 CUBLAS_WORKSPACE_CONFIG=:65536:8 \
          python3 scripts/bench_projections.py "$res/$j/workspace" --rows 64 128 256;
        job $j-attn8b 120 python3 scripts/bench_attention.py "$res/$j/attn8b" --sweep-mixed --heads 32 ;;
    # Decode tiles by programs per SM: the attention GPU tests, then nano paired against the rule before (bench_base/:
    # `git archive a8507ac | tar -x -C bench_base`, untracked; 2 rounds), the 8B geometry paired (1 round), batch 1.
    s18_final) job $j-host 20 python3 scripts/host_speed.py;
        job $j-tests 80 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_attention_gpu.py;
        job $j-nano 200 python3 scripts/bench_matrix.py --out "$res/$j/nano" --rounds 2 --timeout 60 --config now= \
          --config old@bench_base= --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0";
        job $j-8b 140 python3 scripts/bench_matrix.py --out "$res/$j/8b" --rounds 1 --timeout 65 --config now= \
          --config old@bench_base= \
          --workload 8b="experiment=nano model.preset=qwen3-8b bench.num_requests=128 bench.baselines=[] bench.decode_idle_batch=0";
        job $j-b1 110 python3 scripts/bench_matrix.py --out "$res/$j/b1" --rounds 2 --timeout 50 --config now= \
          --workload b1="experiment=nano bench.num_requests=1 bench.baselines=[] bench.decode_idle_batch=0" ;;
    # The targets at this stop after s18_final: a third paired nano round and a second paired 8B round against the
    # rule before (bench_base/ as in s18_final), a third batch-1 run, prefix_bench once, nano with its b256 idle probe.
    s18_targets) job $j-host 20 python3 scripts/host_speed.py;
        job $j-nano 100 python3 scripts/bench_matrix.py --out "$res/$j/nano" --rounds 1 --timeout 60 \
          --config old@bench_base= --config now= --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0";
        job $j-8b 140 python3 scripts/bench_matrix.py --out "$res/$j/8b" --rounds 1 --timeout 65 \
          --config old@bench_base= --config now= \
          --workload 8b="experiment=nano model.preset=qwen3-8b bench.num_requests=128 bench.baselines=[] bench.decode_idle_batch=0";
        job $j-b1 60 python3 scripts/bench_matrix.py --out "$res/$j/b1" --rounds 1 --timeout 50 --config now= \
          --workload b1="experiment=nano bench.num_requests=1 bench.baselines=[] bench.decode_idle_batch=0";
        job $j-prefix 110 python3 -m framework.cli bench experiment=prefix_bench bench.output_dir="$res/$j/prefix";
        job $j-idle 70 python3 -m framework.cli bench experiment=nano bench.baselines=[] bench.output_dir="$res/$j/idle" ;;
    # Decode attention with the q/k norm + RoPE + KV store fused in (model.fuse_rope_attention, in git at 9fbf2e3): its
    # GPU tests and the attention file's, the engine GPU tests with it on, then nano paired on / off (2 rounds).
    s18_rope) job $j-host 20 python3 scripts/host_speed.py;
        job $j-tests 100 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_rope_fused_attention_gpu.py \
          tests/gpu/test_attention_gpu.py;
        job $j-engine 90 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_gpu_engine.py;
        job $j-nano 200 python3 scripts/bench_matrix.py --out "$res/$j/nano" --rounds 2 --timeout 60 --config on= \
          --config off=model.fuse_rope_attention=false \
          --workload nano="experiment=nano bench.baselines=[] bench.decode_idle_batch=0" ;;
    # The decode tile rule's three configs at short contexts against the reference (new test), with the decode tests.
    s18_check) job $j-tests 120 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_attention_gpu.py \
          -k "decode_tiles_of_each_regime or test_decode_qwen3" ;;
    # FP8 KV cache (cache.kv_cache_dtype): its GPU tests (stores byte for byte against torch, attention against the
    # reference at real shapes), then nano, the 8B geometry and batch 1 paired bf16 / fp8 cache.
    s19_fp8) job $j-host 20 python3 scripts/host_speed.py;
        job $j-tests 150 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_attention_gpu.py \
          tests/gpu/test_layer_ops_gpu.py -k "fp8 or store";
        paired_targets $j 2 1 1 bf16= fp8=cache.kv_cache_dtype=fp8 ;;
    # s19_fp8's benchmarks again (its fp8 runs failed: the YAML lacked the new key).
    s19_bench) job $j-host 20 python3 scripts/host_speed.py;
        paired_targets $j 2 1 2 bf16= fp8=cache.kv_cache_dtype=fp8 ;;
    # Why the FP8 cache lost end to end (s19_bench): decode attention per launch over bf16 / e4m3 / e5m2 caches,
    # products in bf16 or float16, a few tile configs.
    s19_sweep) job $j-host 20 python3 scripts/host_speed.py;
        job $j-kv 420 python3 scripts/bench_attention.py "$res/$j/kv" --sweep-kv-dtype ;;
    # FP8 caches multiplying in float16 (after s19_sweep): the FP8 GPU tests, then the paired benchmarks.
    s19_f16) job $j-host 20 python3 scripts/host_speed.py;
        job $j-tests 120 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_attention_gpu.py \
          tests/gpu/test_prefill_attention_gpu.py -k "fp8";
        paired_targets $j 2 1 1 bf16= fp8=cache.kv_cache_dtype=fp8 ;;
    # The attention and fused-store GPU tests whole, a third nano round and second 8B / batch-1 rounds of s19_f16.
    s19_final) job $j-host 20 python3 scripts/host_speed.py;
        job $j-tests 110 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_attention_gpu.py \
          tests/gpu/test_layer_ops_gpu.py;
        paired_targets $j 1 1 1 fp8=cache.kv_cache_dtype=fp8 bf16= ;;
    # The shared-prefix workload (prefill-bound with caching off) on the bf16 and the FP8 cache, one run each.
    s19_prefix) job $j-bf16 125 python3 -m framework.cli bench experiment=prefix_bench bench.output_dir="$res/$j/bf16";
        job $j-fp8 125 python3 -m framework.cli bench experiment=prefix_bench cache.kv_cache_dtype=fp8 \
          bench.output_dir="$res/$j/fp8" ;;
    # FP8 GPU tests (attention, the engine against HF with a rounding cache), then the per-launch sweep; its V
    # converted in column pairs (`s20_pairs`' mode, since removed) lost 0.79-1.0x and changed bits.
    s20_first) job $j-host 20 python3 scripts/host_speed.py;
        job $j-tests 150 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_attention_gpu.py \
          tests/gpu/test_gpu_engine.py -k "fp8";
        job $j-kv 400 python3 scripts/bench_attention.py "$res/$j/kv" --sweep-kv-dtype ;;
    # V's blocks stored transposed (`v_transposed`, keys contiguous: no byte reads of FP8 V from shared memory):
    # its GPU tests (the same bits as the usual layout), then the per-launch sweep with its modes.
    s20_vtrans) job $j-tests 90 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_attention_gpu.py \
          -k "v_transposed";
        job $j-kv 400 python3 scripts/bench_attention.py "$res/$j/kv" --sweep-kv-dtype ;;
    # The issue-25 targets once more at this stop (defaults; the engine path unchanged since the ninth session).
    s20_targets) job $j-host 20 python3 scripts/host_speed.py;
        paired_targets $j 1 1 1 now= ;;
    *) echo "unknown job $j" | tee -a "$out/summary.log" ;;
  esac
done
