"""The pieces of `benchmarks/bench_spec.py` (run that script; these modules are not a public API).

`workloads`: the engines and the requests of a cell; `runs`: one timed run, the round-robin and paired rounds of a
cell, warm-up; `report`: fast-host medians, the paired comparison, the table and the plot.
"""
