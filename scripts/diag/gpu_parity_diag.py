"""GPU diagnosis: greedy parity with HF under several engine settings (prints matches per setting)."""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from hf_models import SPEC_BY_NAME, random_prompts, save_tiny_checkpoint  # noqa: E402

from framework import LLM, SamplingParams  # noqa: E402

path = Path("/tmp/diag_qwen3")
hf = save_tiny_checkpoint(SPEC_BY_NAME["qwen3"], path).to("cuda", torch.float32)
prompts = random_prompts(6, 5, 60, seed=3)
refs = []
for p in prompts:
    ids = torch.tensor([p], device="cuda")
    refs.append(hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                            eos_token_id=None, pad_token_id=None)[0, len(p):].tolist())
settings = {
    "default": {},
    "no_graphs": {"cuda_graphs": False},
    "sync": {"async_scheduling": False},
    "device_history": {"token_history_on_host": False},
    "no_graphs_sync": {"cuda_graphs": False, "async_scheduling": False},
}
for backend in ("triton", "reference"):
    os.environ["MRV2_ATTENTION_BACKEND"] = backend
    for name, kw in settings.items():
        if backend == "reference" and kw.get("cuda_graphs", True):
            kw = {**kw, "cuda_graphs": False}
        llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=128, gpu_memory_utilization=0.2, **kw)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        first = [next((i for i, (a, b) in enumerate(zip(o.token_ids, r)) if a != b), None) for o, r in zip(outs, refs)]
        print(f"{backend:9s} {name:15s} matches={sum(f is None for f in first)}/6 first_diff={first}", flush=True)
        del llm
        torch.cuda.empty_cache()
