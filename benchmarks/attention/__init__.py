"""The pieces of `benchmarks/bench_attention.py` (run that script; these modules are not a public API).

`cases`: the Qwen3-0.6B attention geometry and the paged batches the benchmarks time; `timing`: CUDA-graph,
eager and host timing; `default`: the default decode / prefill table; `sweeps`: tile configs x split counts;
`reduce`: the fused split-KV reduce against two launches, and the decode tile rule against fixed tiles;
`mixed`: nano's mixed-length batches (launch order, tiles); `kv_dtype`: bf16 against FP8 caches; `plots`.
"""
