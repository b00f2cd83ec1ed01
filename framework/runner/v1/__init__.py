"""The V1 runner: a persistent batch whose rows move with the batch, inputs built on the CPU, synchronous
sampling. The fallback for configs V2 cannot serve (see `framework.engine.runner_selection`) and the baseline V2 is
measured
against."""

from framework.runner.v1.model_runner import ModelRunnerV1
from framework.runner.v1.persistent_batch import PersistentBatch

__all__ = ["ModelRunnerV1", "PersistentBatch"]
