"""mrv2's core engine: config, registries, scheduler, KV cache, slots, the V2 and V1 runners, models and the LLM API.

Public API:

```python
from framework import LLM, SamplingParams
outputs = LLM("tiny").generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=16))
```
"""

from framework.config import ConfigError, Mrv2Config, load_config
from framework.engine import EngineCore
from framework.llm import LLM
from framework.pooling_params import EmbeddingOutput, PoolingParams, PoolingRequestOutput
from framework.registry import LOGITS_PROCESSORS, MODEL_STATES, MODELS, SPECULATORS, Registry, RegistryError
from framework.request import RequestOutput
from framework.sampling_params import InvalidRequestError, SamplingParams

__all__ = [
    "ConfigError",
    "EmbeddingOutput",
    "EngineCore",
    "InvalidRequestError",
    "LLM",
    "LOGITS_PROCESSORS",
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
    "load_config",
]
