"""Prometheus metrics shared by every process. Each process serves them on `/metrics`.

Stage-specific metrics are declared next to the stage; the ones here are the loop's own.
"""

from __future__ import annotations

import os

from prometheus_client import Counter, Gauge, Histogram, start_http_server

METRICS_HOST_ENV = "STREAM_RL_METRICS_HOST"

RECORDS_IN = Counter("stream_rl_records_in", "Records consumed", ["stage", "topic"])
RECORDS_OUT = Counter("stream_rl_records_out", "Records produced", ["stage", "topic"])
DLQ = Counter("stream_rl_dlq_records", "Records sent to a dead-letter queue", ["stage", "topic"])
DUPLICATES = Counter("stream_rl_duplicates", "Duplicate records dropped", ["stage"])
BATCH_SECONDS = Histogram(
    "stream_rl_batch_seconds",
    "Time to process one polled batch",
    ["stage"],
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2, 10, 60),
)
UP = Gauge("stream_rl_stage_up", "1 while the stage runs", ["stage"])


def serve_metrics(port: int, host: str | None = None) -> int:
    """Serve `/metrics` on host:port (0 picks a free port); returns the port. The host defaults to
    $STREAM_RL_METRICS_HOST, else 127.0.0.1 (containers set 0.0.0.0 so that Prometheus, in another
    container, can scrape them)."""
    host = host or os.environ.get(METRICS_HOST_ENV) or "127.0.0.1"
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_port)
