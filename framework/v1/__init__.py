"""The V1 runner: a persistent batch whose rows move with the batch, inputs built on the CPU, synchronous
sampling. The fallback for configs V2 cannot serve (see `framework.compat`) and the baseline V2 is measured
against."""

from framework.v1.model_runner import ModelRunnerV1
from framework.v1.persistent_batch import PersistentBatch

__all__ = ["ModelRunnerV1", "PersistentBatch"]
