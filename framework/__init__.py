"""mrv2's core engine: config, registries, scheduler, KV cache, slots, the V2 and V1 runners, models and the LLM API.

Public API:

```python
from framework import LLM, SamplingParams
outputs = LLM("tiny").generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=16))
```
"""

from typing import TYPE_CHECKING, Any

from framework.config.registry import LOGITS_PROCESSORS, MODEL_STATES, MODELS, SPECULATORS, Registry, RegistryError
from framework.config.schema import ConfigError, Mrv2Config, load_config
from framework.engine.request import RequestOutput
from framework.params.lora_request import LoRARequest
from framework.params.pooling_params import EmbeddingOutput, PoolingParams, PoolingRequestOutput
from framework.params.sampling_params import InvalidRequestError, SamplingParams
from framework.params.structured_outputs import StructuredOutputsParams, structured_outputs_from_openai

if TYPE_CHECKING:
    from framework.engine.core import EngineCore
    from framework.engine.failure import EngineDeadError
    from framework.entrypoints.llm import LLM

# `import framework` loads the config schema, the registries and plain types, not the engine: the engine (runners,
# models, kernels, and through `framework.runner.plugins` the plugin packages) loads when `EngineCore` or `LLM` is first
# used. A plugin module that imports `framework.config.registry` or a plain type therefore never loads the engine that
# would import that plugin back, whichever package is imported first.
_LAZY = {
    "EngineCore": "framework.engine.core",
    "EngineDeadError": "framework.engine.failure",
    "LLM": "framework.entrypoints.llm",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'framework' has no attribute '{name}'")


__all__ = [
    "ConfigError",
    "EmbeddingOutput",
    "EngineCore",
    "EngineDeadError",
    "InvalidRequestError",
    "LLM",
    "LOGITS_PROCESSORS",
    "LoRARequest",
    "MODELS",
    "MODEL_STATES",
    "Mrv2Config",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "Registry",
    "RegistryError",
    "SPECULATORS",
    "SamplingParams",
    "StructuredOutputsParams",
    "load_config",
    "structured_outputs_from_openai",
]
