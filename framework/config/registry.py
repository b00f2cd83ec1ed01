"""One small generic registry for models, model states, speculators, logits processors and KV connectors.

Entries come from three places: the `@registry.register("name")` decorator, lazy `"module:Class"` strings
(imported on first use), and Python entry points of the registry's group (e.g. `mrv2.model_states`), which
third-party packages declare in their own `pyproject.toml`. A duplicate name is an error; a plugin that fails
to load is reported by name and does not stop the others.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points
from typing import Any, Callable, Generic, TypeVar, Union

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RegistryError(LookupError):
    """Unknown name, duplicate name, or a plugin that failed to load."""


def import_string(target: str) -> object:
    """Import `"package.module:Attr"`; the error names the target."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise RegistryError(f"'{target}' is not of the form 'module:Attribute'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise RegistryError(f"module '{module_name}' has no attribute '{attr}'") from None


class Registry(Generic[T]):
    """Name -> class (or lazy import string), with entry-point discovery for group `group`."""

    def __init__(self, kind: str, group: str) -> None:
        self.kind = kind
        self.group = group
        self._entries: dict[str, Union[T, str]] = {}
        self._sources: dict[str, str] = {}
        self._broken: dict[str, str] = {}
        self._entry_points_loaded = False

    def register(self, name: str, target: Union[T, str, None] = None, *, source: str = "code") -> Callable[[T], T]:
        """Register `target` under `name`; used bare with a lazy string, or as a class decorator."""

        def add(obj: Union[T, str]) -> Union[T, str]:
            if name in self._entries:
                raise RegistryError(
                    f"{self.kind} '{name}' is registered twice: first {self._entries[name]!r} "
                    f"({self._sources[name]}), then {obj!r} ({source})"
                )
            self._entries[name] = obj
            self._sources[name] = source
            return obj

        if target is not None:
            add(target)
            return lambda obj: obj
        return add  # type: ignore[return-value]

    def unregister(self, name: str) -> None:
        """Remove an entry (tests and plugin reloads)."""
        self._entries.pop(name, None)
        self._sources.pop(name, None)
        self._broken.pop(name, None)

    def load_entry_points(self, force: bool = False) -> None:
        """Discover plugins of this registry's entry-point group (once, unless `force`)."""
        if self._entry_points_loaded and not force:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=self.group):
            source = f"entry point of '{ep.dist.name if ep.dist else '?'}'"
            if self._sources.get(ep.name) == source:
                continue  # already registered by an earlier discovery
            try:
                self.register(ep.name, ep.value, source=source)
            except RegistryError as err:
                self._broken[ep.name] = str(err)
                logger.warning("mrv2 plugin %s '%s' ignored: %s", self.kind, ep.name, err)

    def names(self) -> list[str]:
        """Every registered name (entry points included), sorted."""
        self.load_entry_points()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        self.load_entry_points()
        return name in self._entries

    def get(self, name: str) -> T:
        """The registered object, importing a lazy string on first use."""
        self.load_entry_points()
        if name in self._broken and name not in self._entries:
            raise RegistryError(f"{self.kind} '{name}' failed to load: {self._broken[name]}")
        if name not in self._entries:
            raise RegistryError(f"unknown {self.kind} '{name}'; registered: {', '.join(self.names()) or 'none'}")
        entry = self._entries[name]
        if isinstance(entry, str):
            try:
                entry = import_string(entry)  # type: ignore[assignment]
            except Exception as err:  # a broken plugin must not take the others down
                self._broken[name] = f"{type(err).__name__}: {err}"
                raise RegistryError(
                    f"{self.kind} '{name}' ({self._sources[name]}) failed to load: {type(err).__name__}: {err}"
                ) from err
            self._entries[name] = entry
        return entry  # type: ignore[return-value]


MODELS: Registry[Any] = Registry("model", "mrv2.models")
MODEL_STATES: Registry[Any] = Registry("model state", "mrv2.model_states")
SPECULATORS: Registry[Any] = Registry("speculator", "mrv2.speculators")
LOGITS_PROCESSORS: Registry[Any] = Registry("logits processor", "mrv2.logits_processors")
TOOL_PARSERS: Registry[Any] = Registry("tool parser", "mrv2.tool_parsers")
REASONING_PARSERS: Registry[Any] = Registry("reasoning parser", "mrv2.reasoning_parsers")
KV_CONNECTORS: Registry[Any] = Registry("KV connector", "mrv2.kv_connectors")

# Built-ins are lazy strings so that importing the registry imports no model code.
for _arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    MODELS.register(_arch, "framework.models.llama:LlamaForCausalLM", source="mrv2")
MODELS.register(
    "WhisperForConditionalGeneration", "framework.models.whisper:WhisperForConditionalGeneration", source="mrv2"
)
MODEL_STATES.register("default", "model_states.default:DefaultModelState", source="mrv2")
SPECULATORS.register("ngram", "speculators.ngram:NgramSpeculator", source="mrv2")
MODEL_STATES.register("encoder_decoder", "model_states.encoder_decoder:EncoderDecoderModelState", source="mrv2")
for _name, _cls in (("eagle", "EagleSpeculator"), ("eagle3", "Eagle3Speculator"), ("mtp", "MTPSpeculator")):
    SPECULATORS.register(_name, f"speculators.eagle:{_cls}", source="mrv2")
MODELS.register("JambaForCausalLM", "framework.models.jamba:JambaForCausalLM", source="mrv2")
MODELS.register("Gemma3ForCausalLM", "framework.models.gemma3:Gemma3ForCausalLM", source="mrv2")
MODELS.register("Gemma4ForCausalLM", "framework.models.gemma4:Gemma4ForCausalLM", source="mrv2")
MODELS.register("GptOssForCausalLM", "framework.models.gpt_oss:GptOssForCausalLM", source="mrv2")
for _arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"):
    MODELS.register(_arch, "framework.models.moe:MoeForCausalLM", source="mrv2")
MODEL_STATES.register("mamba_hybrid", "model_states.mamba_hybrid:MambaHybridModelState", source="mrv2")
MODEL_STATES.register("hybrid_recurrent", "model_states.hybrid_recurrent:HybridRecurrentModelState", source="mrv2")
for _arch in ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"):
    MODELS.register(_arch, "framework.models.qwen3_next:Qwen3NextForCausalLM", source="mrv2")
_TOOLS = "framework.entrypoints.tool_parsers"
for _name, _target in (
    ("hermes", "hermes:HermesToolParser"),
    ("qwen3_coder", "qwen3_coder:Qwen3CoderToolParser"),
    ("llama3_json", "llama3_json:Llama3JsonToolParser"),
    ("mistral", "mistral:MistralToolParser"),
):
    TOOL_PARSERS.register(_name, f"{_TOOLS}.{_target}", source="mrv2")
for _name, _target in (("think", "Think"), ("qwen3", "Think"), ("deepseek_r1", "DeepSeekR1")):
    REASONING_PARSERS.register(_name, f"framework.entrypoints.reasoning_parser:{_target}ReasoningParser", source="mrv2")
KV_CONNECTORS.register("host", "framework.kv_transfer.host_connector:HostKVConnector", source="mrv2")
