import sys, torch
sys.path.insert(0, "tests/gpu")
import test_sampler_fused_gpu as T
from samplers.fused_sampling import sample_fused_triton
from samplers.reference import sample_reference as sample_fused_reference
for kind in ("flat", "peaked"):
    logits = T._logits(kind, 0); params = T._params(1)
    idx = torch.randint(0, len(params.seed), (T.ROWS,), device="cuda", dtype=torch.int32)
    positions = torch.randint(0, 1 << 20, (T.ROWS,), device="cuda")
    got = sample_fused_triton(logits, idx, positions, params); ref = sample_fused_reference(logits, idx, positions, params)
    bad = (got.errors != ref.errors).nonzero().flatten().tolist()
    print(kind, "rows with different errors:", bad[:20], "sampled mismatches:", int((got.sampled != ref.sampled).sum()))
    for r in bad[:6]:
        s = int(idx[r]); print("  row", r, "got", int(got.errors[r]), "ref", int(ref.errors[r]), "temp", float(params.temperature[s]),
              "k", int(params.top_k[s]), "p", float(params.top_p[s]), "minp", float(params.min_p[s]),
              "tok got/ref", int(got.sampled[r]), int(ref.sampled[r]))
