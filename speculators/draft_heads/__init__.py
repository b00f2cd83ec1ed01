"""Draft heads of the model-based speculators: EAGLE (EAGLE-1), EAGLE-3 and MTP, as plain PyTorch modules.

Each head has a full-sequence forward (training, test references) and a paged forward (the speculator),
loads strictly from an HF-style directory (`load_draft_head`) and saves to one (`save_pretrained`).
Checkpoint layouts are in each module's docstring and in docs/speculative-heads.md.
"""

from speculators.draft_heads.base import DraftHead
from speculators.draft_heads.configs import head_config
from speculators.draft_heads.eagle import EagleHead
from speculators.draft_heads.eagle3 import Eagle3Head
from speculators.draft_heads.io import HEAD_CLASSES, head_class, load_draft_head
from speculators.draft_heads.mtp import MTPHead
from speculators.draft_heads.qwen3_next_mtp import Qwen3NextMTPHead

__all__ = [
    "DraftHead",
    "Eagle3Head",
    "EagleHead",
    "HEAD_CLASSES",
    "MTPHead",
    "Qwen3NextMTPHead",
    "head_class",
    "head_config",
    "load_draft_head",
]
