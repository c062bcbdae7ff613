"""What the stage commands share: options, config, transport, metrics endpoint, signals.

    stream-rl actor --config run.yaml [--bootstrap HOST:PORT] [--instance ID] [--max-records N]
                    [--idle-timeout S] [--metrics-port P] [--set actor.group_size=4]

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

from stream_rl.cli import add_common
from stream_rl.config import RunConfig, load_config
from stream_rl.kafka.stage import StageStats, StopFlag
from stream_rl.kafka.transport import Transport
from stream_rl.metrics import UP, serve_metrics

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


def add_stage_arguments(parser: argparse.ArgumentParser) -> None:
    """`--config/--set/--bootstrap`, the bounds, `--metrics-port` and `--instance`."""
    add_common(parser, bounded=True)
    parser.add_argument(
        "--instance",
        type=instance_id,
        default="0",
        help="id of this process among the stage's processes, unique per replica: 0, 1, ... or a "
        "hostname (client, group member and transactional ids)",
    )


def open_transport(config: RunConfig, transport: Transport | None) -> Transport:
    """The given transport, or a Kafka one for the configured (or resolved) bootstrap."""
    if transport is not None:
        return transport
    from stream_rl.kafka.broker import resolve_bootstrap
    from stream_rl.kafka.client import KafkaTransport

    kafka = KafkaTransport(
        resolve_bootstrap(None, config.kafka.bootstrap, config.kafka.data_dir),
        outage_s=config.kafka.outage_timeout_s,
    )
    kafka.check_reachable()  # a wrong address is one line within seconds, not librdkafka's retries
    return kafka


def stage_config(args: argparse.Namespace) -> RunConfig:
    """The run config of a stage command, `--bootstrap` folded into `kafka.bootstrap`."""
    overrides = list(args.overrides)
    if args.bootstrap:
        overrides.append(f"kafka.bootstrap={args.bootstrap}")
    return load_config(args.config, overrides)


def run_stage_command(name: str, run: StageRun, args: argparse.Namespace) -> int:
    """Load the config, install the signal handlers, serve metrics, run the stage, print a summary."""
    config = stage_config(args)
    stop = StopFlag()
    stop.install_signal_handlers()
    if args.metrics_port is not None:
        port = serve_metrics(args.metrics_port)
        log.info("%s: metrics on http://127.0.0.1:%d/metrics", name, port)
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
