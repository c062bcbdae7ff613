"""What the stage commands share: options, config, transport, metrics endpoint, signals.

    stream-rl actor --config run.yaml [--bootstrap HOST:PORT] [--instance ID] [--max-records N]
                    [--idle-timeout S] [--metrics-port P] [--set actor.group_size=4]

The trainer takes the same options with `--max-steps N` for `--max-records N` (it is bounded by
versions, not records), and only `--instance 0` (one trainer per run).

`--instance` names one process among a stage's processes: the launcher passes 0, 1, 2...,
`docker compose` the container's hostname. It goes into client ids, the static group member id
and the preprocessor's transactional id, so it must be unique per replica and stable across
restarts of the same replica (a restarted replica then takes its partitions back at once and
fences its dead predecessor).

SIGTERM or Ctrl-C stops the stage the way its loop drains (finish the work in hand, commit,
close); the exit status is 0, or 2 with a one-line message for errors a user can act on.
"""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from stream_rl.cli import add_common
from stream_rl.common.metrics import UP, serve_metrics
from stream_rl.config import RunConfig, load_config
from stream_rl.kafka.stage import StageStats, StopFlag
from stream_rl.kafka.transport import Transport

if TYPE_CHECKING:
    from stream_rl.kafka.confluent import KafkaTransport

log = logging.getLogger(__name__)

StageRun = Callable[..., StageStats]
Instance = int | str
"""A stage process's id among its stage's processes (see the module docstring)."""

_INSTANCE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def instance_id(value: str) -> str:
    """argparse type of `--instance`: letters, digits, `_`, `.`, `-` (a Kafka client id,
    transactional id and group instance id may hold them all); at most 64 characters."""
    if not _INSTANCE_RE.match(value):
        raise argparse.ArgumentTypeError(
            f"invalid instance id {value!r}: use letters, digits, '_', '.', '-' (e.g. 0, 1 or a hostname)"
        )
    return value


def add_stage_arguments(
    parser: argparse.ArgumentParser, bound: str = "records", bound_help: str = "stop after N input records"
) -> None:
    """`--config/--set/--bootstrap`, the bounds (`--max-{bound}`, `--idle-timeout`), `--metrics-port`
    and `--instance`."""
    add_common(parser)
    parser.add_argument(f"--max-{bound}", type=int, default=None, help=bound_help)
    parser.add_argument("--idle-timeout", type=float, default=None, help="stop after S seconds without input")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics on this port (0 = any free port)",
    )
    parser.add_argument(
        "--instance",
        type=instance_id,
        default="0",
        help="id of this process among the stage's processes, unique per replica: 0, 1, ... or a "
        "hostname (client, group member and transactional ids)",
    )


def kafka_transport(config: RunConfig) -> KafkaTransport:
    """The Kafka transport of a stage (`KafkaTransport.for_run`). Nothing is contacted yet."""
    from stream_rl.kafka.confluent import KafkaTransport

    return KafkaTransport.for_run(config.kafka)


def open_transport(config: RunConfig, transport: Transport | None) -> Transport:
    """The given transport, or `kafka_transport(config)` once the broker answers."""
    if transport is not None:
        return transport
    kafka = kafka_transport(config)
    kafka.check_reachable()  # a wrong address is one line within seconds, not librdkafka's retries
    return kafka


def stage_config(args: argparse.Namespace, role: str | None = None) -> RunConfig:
    """The run config of a stage command, `--bootstrap` folded into `kafka.bootstrap`; with `role`,
    as that kind of process sees it (its own `kafka.credentials` entry only: `KafkaConfig.for_role`)."""
    overrides = list(args.overrides)
    if args.bootstrap:
        overrides.append(f"kafka.bootstrap={args.bootstrap}")
    config = load_config(args.config, overrides)
    if role is None:
        return config
    return config.model_copy(update={"kafka": config.kafka.for_role(role)})


def start_stage(name: str, metrics_port: int | None) -> StopFlag:
    """Install the signal handlers (SIGTERM/SIGINT set the returned flag) and serve `/metrics` on
    `metrics_port` (None: not served)."""
    stop = StopFlag()
    stop.install_signal_handlers()
    if metrics_port is not None:
        port = serve_metrics(metrics_port)
        log.info("%s: metrics on http://127.0.0.1:%d/metrics", name, port)
    return stop


def run_stage_command(name: str, run: StageRun, args: argparse.Namespace) -> int:
    """Load the config, install the signal handlers, serve metrics, run the stage, print a summary."""
    config = stage_config(args, name)
    stop = start_stage(name, args.metrics_port)
    UP.labels(name).set(1)
    try:
        stats = run(
            config,
            stop=stop,
            max_records=args.max_records,
            idle_timeout_s=args.idle_timeout,
            instance=args.instance,
        )
    finally:
        UP.labels(name).set(0)
    extra = "".join(f", {k}={v:g}" for k, v in sorted(stats.extra.items()))
    print(
        f"{name}: {stats.records_in} in, {stats.records_out} out, {stats.dlq} to the DLQ "
        f"(stopped by {stats.stopped_by or 'end of input'}{extra})",
        flush=True,
    )
    return 0
