"""`stream-rl servers join|leave|list`: inference servers joining and leaving a run that goes on.

    stream-rl servers join  --config run.yaml --url http://10.0.0.7:8001 [--engine vllm]
    stream-rl servers leave --config run.yaml --url http://10.0.0.7:8001
    stream-rl servers list  --config run.yaml

`join` waits until the server answers its health route, writes `joined` to the run's `servers`
topic, then (unless `--no-wait`) waits until the server reports holding the newest published
version: the trainer pushes it that version when it reads the record, and the actors route to it
only from then on. `leave` writes `draining` (no new request is routed to it; the trainer stops
pushing to it), waits until the server has no request running or waiting (its `/metrics`), then
writes `left`: the server can be stopped. The records and what each reader does are in
`docs/servers-protocol.md`; the topic's readers in `stream_rl.kafka.servers_topic`.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from collections.abc import Callable

from stream_rl.cli import add_common
from stream_rl.config import RunConfig
from stream_rl.config.inference import normalize_url
from stream_rl.contracts import MembershipState, ServerMembership
from stream_rl.errors import ConfigError, InferenceError
from stream_rl.kafka.servers_topic import announce, read_members
from stream_rl.kafka.topics import SERVERS, TopicNames
from stream_rl.kafka.transport import Transport

LOAD_METRICS = {
    "builtin": ("stream_rl_inference_running", "stream_rl_inference_waiting"),
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
}
"""The Prometheus gauges of each engine's requests running and waiting (`leave` waits for 0)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["join", "leave", "list"])
    add_common(parser)
    parser.add_argument("--url", help="the server's base URL, e.g. http://10.0.0.7:8001 (join, leave)")
    parser.add_argument(
        "--engine",
        choices=["builtin", "vllm", "sglang"],
        help="the server's engine (default: inference.engine)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="join: how long the server may take to answer /health and then to hold the newest "
        "version; leave: how long its requests may take to drain (default 600)",
    )
    parser.add_argument("--no-wait", action="store_true", help="join: return once the record is written")


def _who() -> str:
    return f"stream-rl servers on {socket.gethostname()}"


def _transport(config: RunConfig) -> tuple[Transport, TopicNames]:
    from stream_rl.stages.entry import open_transport

    names = TopicNames(run=config.run, prefix=config.kafka.prefix)
    transport = open_transport(config, None)
    if names[SERVERS] not in set(transport.list_topic_names()):
        raise ConfigError(
            f"run {config.run!r} has no topic {names[SERVERS]}: its topics predate server membership "
            f"or were never made; run `stream-rl topics apply --config ...` first"
        )
    return transport, names


def _client(engine: str, url: str, api_key: str | None = None) -> object:
    from stream_rl.inference.clients import make_client

    return make_client(engine, url, timeout_s=5.0, api_key=api_key)


async def _healthy(engine: str, url: str, timeout_s: float) -> None:
    client = _client(engine, url)
    deadline = time.monotonic() + timeout_s
    last: str = ""
    try:
        while True:
            try:
                await client.health()  # type: ignore[attr-defined]
                return
            except InferenceError as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                raise InferenceError(
                    f"{url} did not answer its health route within {timeout_s:.0f} s: {last}"
                )
            await asyncio.sleep(1.0)
    finally:
        await client.aclose()  # type: ignore[attr-defined]


async def _held(engine: str, url: str, api_key: str | None = None) -> int | None:
    client = _client(engine, url, api_key)
    try:
        return await client.version()  # type: ignore[attr-defined]
    except InferenceError:
        return None
    finally:
        await client.aclose()  # type: ignore[attr-defined]


def _newest(transport: Transport, names: TopicNames) -> int | None:
    from stream_rl.observe.status import latest_version

    wv = latest_version(transport, names)
    return None if wv is None else wv.version


def load(engine: str, url: str) -> float | None:
    """Requests running plus waiting on the server (its `/metrics`); None if unreadable."""
    from stream_rl.observe.status import scrape

    metrics = scrape(f"{url}/metrics", timeout=2.0)
    if metrics is None:
        return None
    names = LOAD_METRICS[engine]
    if not any(n in metrics for n in names):
        return None
    return sum(metrics.get(n, 0.0) for n in names)


def join_server(
    transport: Transport,
    names: TopicNames,
    url: str,
    engine: str,
    timeout_s: float,
    wait: bool = True,
    say: Callable[[str], None] = print,
    who: str | None = None,
    api_key: str | None = None,
) -> float | None:
    """The join of docs/servers-protocol.md: wait for its health route, write `joined`, then
    (with `wait`) until it holds the newest published version. Returns the seconds from the record
    to that (None without `wait`); raises `InferenceError` on a timeout. `api_key`: the server's
    OpenAI-routes key (the built-in server reports its version on `/v1/models`)."""
    started = time.monotonic()
    asyncio.run(_healthy(engine, url, timeout_s))
    member = ServerMembership(names.run, url, engine, MembershipState.JOINED, who or _who())
    announce(transport, names, member)
    written = time.monotonic()
    say(f"{url}: healthy; 'joined' written to {names[SERVERS]} ({written - started:.1f} s)")
    if not wait:
        return None
    deadline = written + timeout_s
    while True:
        newest = _newest(transport, names)
        held = asyncio.run(_held(engine, url, api_key))
        if newest is not None and held is not None and held >= newest:
            took = time.monotonic() - written
            say(
                f"{url}: holds version {held}, the newest, {took:.1f} s after joining: the actors route to it from now on"
            )
            return took
        if time.monotonic() > deadline:
            raise InferenceError(
                f"{url} holds version {held}, not the newest ({newest}), {timeout_s:.0f} s after joining: "
                "is the trainer running, and can it reach the server (trainer log: 'joined the run')?"
            )
        time.sleep(0.5)


def leave_server(
    transport: Transport,
    names: TopicNames,
    url: str,
    engine: str,
    timeout_s: float,
    say: Callable[[str], None] = print,
    who: str | None = None,
) -> float:
    """The leave of docs/servers-protocol.md: write `draining`, wait until nothing runs or waits
    on it (at most `timeout_s`), write `left`. Returns the seconds it took."""
    who = who or _who()
    announce(transport, names, ServerMembership(names.run, url, engine, MembershipState.DRAINING, who))
    started = time.monotonic()
    say(f"{url}: 'draining' written: no new request is routed to it")
    idle = 0
    while idle < 2:  # two readings in a row: a request routed just before the record was read shows
        current = load(engine, url)
        if current is None:
            say(f"{url}: its /metrics cannot be read (stopped?): taken as drained")
            break
        idle = idle + 1 if current == 0 else 0
        if time.monotonic() - started > timeout_s:
            say(
                f"{url}: still {current:.0f} request(s) after {timeout_s:.0f} s; leaving anyway (the actors "
                "retry them elsewhere when it stops)"
            )
            break
        time.sleep(0.5)
    announce(transport, names, ServerMembership(names.run, url, engine, MembershipState.LEFT, who))
    took = time.monotonic() - started
    say(f"{url}: drained in {took:.1f} s; 'left' written: the server can be stopped")
    return took


def listing(config: RunConfig) -> int:
    from stream_rl.observe.status import table

    transport, names = _transport(config)
    members = read_members(transport, names)
    rows: list[tuple[str, ...]] = [("server", "engine", "membership", "announced by")]
    for s in config.inference.server_list():
        if s.url not in members:
            rows.append((s.url, str(s.engine), "configured", "-"))
    for m in members.values():
        rows.append((m.url, m.engine, m.state.value, m.announced_by or "-"))
    print(table(rows))
    return 0


def main(args: argparse.Namespace) -> int:
    from stream_rl.stages.entry import stage_config

    config = stage_config(args)  # --bootstrap folded in
    if args.action == "list":
        if args.url or args.engine:
            raise ConfigError("servers list takes no --url or --engine")
        return listing(config)
    if not args.url:
        raise ConfigError(f"servers {args.action} needs --url (the server's base URL)")
    try:
        url = normalize_url(args.url)
    except ValueError as exc:
        raise ConfigError(f"--url: {exc}") from None
    configured = {s.url: str(s.engine) for s in config.inference.server_list()}
    engine = args.engine or configured.get(url) or config.inference.engine
    if args.action == "leave" and args.no_wait:
        raise ConfigError("--no-wait is for join")
    transport, names = _transport(config)
    if args.action == "join":
        secret = config.inference.api_key_secret()
        key = secret.get_secret_value() if secret else None
        join_server(transport, names, url, engine, args.timeout_s, wait=not args.no_wait, api_key=key)
    else:
        leave_server(transport, names, url, engine, args.timeout_s)
    return 0
