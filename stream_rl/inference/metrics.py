"""Prometheus metrics of one inference server, in its own registry (several servers may share a
process in tests). Engine figures are read at scrape time; update timings are observed when an
update completes.

Series: `stream_rl_inference_running`, `_waiting` (sequences), `_tokens_per_second` (last ~5 s),
`_generated_tokens_total`, `_finished_requests_total`, `_busy_seconds_total` (time the decode loop
spent working: `1 - rate(busy)` is the engine's idle fraction), `_max_batch` (KV slots),
`_sequence_seconds_total` (running sequences integrated over time: `rate(sequence_seconds) /
max_batch` is the batch occupancy, the share of slots decoding), `_kv_cache_bytes` and
`_kv_cache_max_bytes` (allocated now; at every slot full), `_max_len` (longest sequence),
`_weight_version`, `_engine_up`,
`_requests_total{endpoint,status}`, `_weight_update_receive_seconds`, `_weight_update_stall_seconds`,
`_weight_updates_total{outcome}`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stream_rl.inference.engine import Engine

PREFIX = "stream_rl_inference"
_UPDATE_BUCKETS = (0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        yield GaugeMetricFamily(f"{PREFIX}_running", "Sequences being decoded", value=s.running)
        yield GaugeMetricFamily(f"{PREFIX}_waiting", "Sequences waiting for a slot", value=s.waiting)
        yield GaugeMetricFamily(
            f"{PREFIX}_tokens_per_second", "Generated tokens/s over the last ~5 s", value=s.tokens_per_s
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_max_batch", "Sequences decoded together at most", value=s.max_batch
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_cache_bytes", "KV cache bytes allocated (all slots)", value=s.kv_cache_bytes
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_cache_max_bytes",
            "KV cache bytes with every slot at the maximum length",
            value=s.kv_cache_max_bytes,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_max_len", "Longest sequence (prompt + completion)", value=s.max_len
        )
        yield GaugeMetricFamily(f"{PREFIX}_weight_version", "Weight version in force", value=s.version)
        yield GaugeMetricFamily(f"{PREFIX}_engine_up", "1 while the decode loop runs", value=int(s.alive))
        yield CounterMetricFamily(f"{PREFIX}_generated_tokens", "Tokens generated", value=s.generated_tokens)
        yield CounterMetricFamily(
            f"{PREFIX}_finished_requests", "Requests completed", value=s.finished_requests
        )
        yield CounterMetricFamily(
            f"{PREFIX}_busy_seconds", "Seconds the decode loop spent working (not waiting)", value=s.busy_s
        )
        yield CounterMetricFamily(
            f"{PREFIX}_sequence_seconds",
            "Running sequences integrated over time (rate / max_batch = batch occupancy)",
            value=s.sequence_s,
        )


class ServerMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.requests = Counter(
            f"{PREFIX}_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.receive_seconds = Histogram(
            f"{PREFIX}_weight_update_receive_seconds",
            "Time to receive an update's tensors into shadow buffers",
            buckets=_UPDATE_BUCKETS,
            registry=self.registry,
        )
        self.stall_seconds = Histogram(
            f"{PREFIX}_weight_update_stall_seconds",
            "Decode pause caused by installing an update",
            buckets=_UPDATE_BUCKETS,
            registry=self.registry,
        )
        self.updates = Counter(
            f"{PREFIX}_weight_updates", "Weight updates by outcome", ["outcome"], registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
