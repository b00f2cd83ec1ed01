"""`/metrics`: Prometheus text, every name prefixed `mrv2:` (or `vllm:`, `serve.metrics_names`), in a registry of
the server's own (no globals). docs/scaling-out.md maps the names to what routers read.

Gauges and engine counters are read from the engine's latest `EngineStats` at scrape time; request latencies
are observed by the API server (from the HTTP request's arrival).
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from framework.entrypoints.serve.engine_client import RankState
from framework.entrypoints.serve.protocol import EngineStats

RankStats = Callable[[], list[RankState]]  # the engine cores (one without data parallelism)

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)


class _EngineCollector:
    """Exports the engine's gauges and counters as of its latest step (summed over data-parallel ranks), the
    cache layout routers read (`cache_config_info`) and, with several ranks, each rank's gauges."""

    def __init__(
        self, stats: Callable[[], Optional[EngineStats]], model: str, prefix: str, ranks: RankStats, block_size: int
    ) -> None:
        self._stats = stats
        self._model = model
        self._prefix = prefix
        self._ranks = ranks
        self._block_size = block_size

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:
            return
        p = self._prefix
        used = s.num_blocks - s.num_free_blocks
        for name, doc, value in (
            ("num_requests_running", "Requests holding a slot in the engine.", s.num_running),
            ("num_requests_waiting", "Requests queued in the engine.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", used / max(s.num_blocks, 1)),
            ("gpu_cache_usage_perc", "Same as kv_cache_usage_perc (the older name).", used / max(s.num_blocks, 1)),
            ("kv_cache_blocks_free", "KV blocks free (cached prefixes included).", s.num_free_blocks),
            ("kv_cache_blocks_total", "KV blocks in the pool.", s.num_blocks),
            ("kv_host_tier_blocks", "KV blocks held in the host-memory tier.", s.kv_tier_blocks_held),
            (
                "kv_host_tier_snapshots",
                "Recurrent-state snapshots (hybrid models) held in the host-memory tier.",
                s.kv_tier_snapshots_held,
            ),
        ):
            gauge = GaugeMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            gauge.add_metric([self._model], value)
            yield gauge
        info = GaugeMetricFamily(
            f"{p}:cache_config_info", "KV cache layout (value 1).", labels=["block_size", "num_gpu_blocks"]
        )
        info.add_metric([str(self._block_size), str(s.num_blocks)], 1)
        yield info
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits),
            ("spec_decode_num_drafts", "Speculative verification rows.", s.spec_num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens),
            ("kv_host_tier_hits", "Prompt tokens loaded from the host KV tier.", s.kv_tier_hit_tokens),
            ("kv_host_tier_failed_loads", "Host KV tier block loads that failed.", s.kv_tier_failed_loads),
            (
                "kv_host_tier_snapshot_hits",
                "Recurrent-state snapshots (hybrid models) loaded from the host KV tier: one ends each such hit.",
                s.kv_tier_snapshot_hits,
            ),
        ):
            counter = CounterMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            counter.add_metric([self._model], value)
            yield counter
        moved = CounterMetricFamily(
            f"{p}:kv_host_tier_bytes", "KV bytes copied to / from the host tier.", labels=["model_name", "direction"]
        )
        moved.add_metric([self._model, "to_host"], s.kv_tier_bytes_to_host)
        moved.add_metric([self._model, "to_device"], s.kv_tier_bytes_to_device)
        yield moved
        latency = SummaryMetricFamily(
            f"{p}:kv_host_tier_load_seconds", "Device time of each step's host-tier loads.", labels=["model_name"]
        )
        latency.add_metric([self._model], count_value=s.kv_tier_loads, sum_value=s.kv_tier_load_seconds)
        yield latency
        yield from self._per_rank()

    def _per_rank(self) -> Iterator[Metric]:
        ranks = self._ranks()
        if len(ranks) < 2:
            return
        labels = ["model_name", "data_parallel_rank"]
        families = {
            "up": GaugeMetricFamily(f"{self._prefix}:data_parallel_rank_up", "1 while the rank runs.", labels=labels),
            "running": GaugeMetricFamily(
                f"{self._prefix}:data_parallel_rank_num_requests_running", "Running requests.", labels=labels
            ),
            "waiting": GaugeMetricFamily(
                f"{self._prefix}:data_parallel_rank_num_requests_waiting", "Queued requests.", labels=labels
            ),
            "usage": GaugeMetricFamily(
                f"{self._prefix}:data_parallel_rank_kv_cache_usage_perc", "KV blocks in use.", labels=labels
            ),
        }
        for rank in ranks:
            key, r = [self._model, str(rank.rank)], rank.stats
            families["up"].add_metric(key, 1 if rank.dead is None else 0)
            if r is not None:
                families["running"].add_metric(key, r.num_running)
                families["waiting"].add_metric(key, r.num_waiting)
                families["usage"].add_metric(key, (r.num_blocks - r.num_free_blocks) / max(r.num_blocks, 1))
        yield from families.values()


class ServerMetrics:
    """The server's Prometheus registry: request counters and latency histograms, plus the engine's stats."""

    def __init__(
        self,
        model: str,
        stats: Callable[[], Optional[EngineStats]],
        prefix: str = "mrv2",
        ranks: Optional[RankStats] = None,
        block_size: int = 16,
    ) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.prompt_tokens = Counter(
            f"{prefix}:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=self.registry
        ).labels(model)
        self.generation_tokens = Counter(
            f"{prefix}:generation_tokens", "Generated tokens of finished requests.", labels, registry=self.registry
        ).labels(model)
        self.requests = Counter(
            f"{prefix}:request_success",
            "Finished requests by finish reason.",
            labels + ["finished_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            f"{prefix}:time_to_first_token_seconds",
            "Time from arrival to the first output token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.tpot = Histogram(
            f"{prefix}:time_per_output_token_seconds",
            "Mean time per output token after the first.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.e2e = Histogram(
            f"{prefix}:e2e_request_latency_seconds",
            "Time from arrival to the last output token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model)
        self.registry.register(_EngineCollector(stats, model, prefix, ranks or (lambda: []), block_size))

    def observe_request(
        self,
        arrival: float,
        first_token: Optional[float],
        end: float,
        num_prompt_tokens: int,
        num_output_tokens: int,
        finish_reason: str,
    ) -> None:
        """Record one finished request (times from `time.perf_counter()`)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        self.requests.labels(self.model, finish_reason).inc()
        self.e2e.observe(end - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_output_tokens > 1:
                self.tpot.observe((end - first_token) / (num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
