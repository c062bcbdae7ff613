"""`stream-rl status [--run R]`: the live picture of a run.

Per stage process: alive or not, records in/out per second (from its `/metrics`); per
inference server: health, weight version, running/waiting sequences, tokens/s; per consumer
group and topic: lag and the age of the oldest unconsumed record; the trainer's version, step,
reward and version lag (from `weight-versions`). Reads `runs/<run>/processes.json` (written by
`stream-rl run`) for the processes; without it (e.g. a docker compose run) it shows the Kafka
side only. Refreshes every `--every` seconds until Ctrl-C; `--once` prints one table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from stream_rl.cli import add_common
from stream_rl.config import KafkaConfig, load_config
from stream_rl.contracts import Contract, EvalResult, MembershipState, ServerMembership, WeightVersion
from stream_rl.errors import ContractError, KafkaError, StreamRLError
from stream_rl.kafka.broker import pid_alive, resolve_bootstrap
from stream_rl.kafka.lag import run_lags
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.servers_topic import read_members
from stream_rl.kafka.topics import EVAL_RESULTS, WEIGHT_VERSIONS, TopicNames
from stream_rl.kafka.transport import Transport
from stream_rl.observe.autoscaling import read_state, status_lines

C = TypeVar("C", bound=Contract)


def scrape(url: str, timeout: float = 1.0) -> dict[str, float] | None:
    """Sum of each sample name's values on a Prometheus endpoint (None if it does not answer)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url, timeout=timeout).text
    except httpx.HTTPError:
        return None
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def _healthy(url: str, timeout: float = 1.0) -> bool:
    """`GET /health` answers 200: the built-in server's and vLLM's alike."""
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def _last_record(transport: Transport, topic: str, cls: type[C]) -> C | None:
    """The last decodable record of a single-partition topic (None when empty or missing)."""
    try:
        low, high = transport.watermarks(topic).get(0, (0, 0))
    except KafkaError:  # no such topic (a run from before the topic existed)
        return None
    if high <= low:
        return None
    consumer = transport.consumer(None, "stream-rl-status")
    try:
        consumer.assign({(topic, 0): max(high - 5, low)})  # the last records (skip txn markers)
        msgs = consumer.poll_batch(10, 3.0)
    finally:
        consumer.close()
    for msg in reversed(msgs):
        try:
            return default_serde().decode(msg.value, cls)
        except ContractError:
            continue
    return None


def latest_version(transport: Transport, names: TopicNames) -> WeightVersion | None:
    return _last_record(transport, names[WEIGHT_VERSIONS], WeightVersion)


def latest_eval(transport: Transport, names: TopicNames) -> EvalResult | None:
    return _last_record(transport, names[EVAL_RESULTS], EvalResult)


def eval_line(ev: EvalResult | None) -> str:
    if ev is None:
        return "eval: no evaluation published yet (eval.every > 0 runs the evaluator)"
    parts = [f"eval: version {ev.version} on {ev.split} ({ev.num_problems} problems)"]
    if ev.sampled_pass_at_1 is not None:
        parts.append(f"sampled pass@1 {ev.sampled_pass_at_1:.3f} (T={ev.temperature:g})")
    if ev.pass_at_k is not None:
        parts.append(f"pass@{ev.k} {ev.pass_at_k:.3f}")
    if ev.pass_at_1 is not None:
        parts.append(f"greedy pass@1 {ev.pass_at_1:.3f}")
    parts.append(f"mean length {ev.mean_length:.1f}, off-version tokens {ev.off_version_token_frac:.3f}")
    return ", ".join(parts)


def table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


class StatusView:
    def __init__(
        self, run: str, run_dir: Path, transport: Transport, names: TopicNames, servers: Sequence[str] = ()
    ) -> None:
        self.run = run
        self.servers = list(servers)
        """The config's servers, for a run without `processes.json` (a compose or hand-started run)."""
        self.run_dir = run_dir
        self.transport = transport
        self.names = names
        self._last: dict[str, tuple[float, dict[str, float]]] = {}

    def processes(self) -> dict[str, Any]:
        path = self.run_dir / "processes.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _rate(self, key: str, metrics: dict[str, float] | None, name: str) -> str:
        if metrics is None:
            return "-"
        now = time.monotonic()
        prev = self._last.get(key)
        self._last[key] = (now, metrics)
        if prev is None or now <= prev[0]:
            return "…"
        return f"{(metrics.get(name, 0.0) - prev[1].get(name, 0.0)) / (now - prev[0]):.1f}"

    @staticmethod
    def membership(configured: Sequence[str], members: Mapping[str, ServerMembership]) -> dict[str, str]:
        """url -> `config` (a configured member), or its state from the `servers` topic (`joined`,
        `draining`, `left`); servers that joined and left are not shown."""
        out = dict.fromkeys(configured, "config")
        for url, m in members.items():
            if url in out:
                out[url] = "config" if m.routable else m.state.value
            elif m.state != MembershipState.LEFT:
                out[url] = m.state.value
        return out

    @staticmethod
    def server_rows(
        servers: Sequence[str], wv: WeightVersion | None, membership: Mapping[str, str] | None = None
    ) -> list[tuple[str, ...]]:
        """Per server: health, the version it serves, how many versions it is behind the trainer's
        last, what the last version's push did to it (`ok`, `failed`, `-`: not pushed to), load;
        with `membership` (`membership()`), a column saying how it is a member of the run."""
        rows: list[tuple[str, ...]] = [
            ("server", "health", "version", "behind", "last push", "running", "waiting", "tokens/s")
        ]
        if membership is not None:
            rows[0] = (rows[0][0], "member", *rows[0][1:])
        for url in servers:
            sm = scrape(f"{url}/metrics")
            held = None if sm is None else sm.get("stream_rl_inference_weight_version")
            behind = "-" if wv is None or held is None else str(wv.version - int(held))
            push = (
                "-" if wv is None
                else "ok" if url in wv.servers_updated
                else "failed" if url in wv.servers_failed
                else "-"
            )  # fmt: skip
            rows.append(
                (
                    url,
                    "ok" if _healthy(url) else "DOWN",
                    "-" if held is None else str(int(held)),
                    behind,
                    push,
                    *(
                        str(int(sm.get(k, 0))) if sm else "-"
                        for k in ("stream_rl_inference_running", "stream_rl_inference_waiting")
                    ),
                    f"{sm.get('stream_rl_inference_tokens_per_second', 0):.0f}" if sm else "-",
                )
            )
            if membership is not None:
                rows[-1] = (url, membership.get(url, "-"), *rows[-1][1:])
        return rows

    def render(self) -> str:
        parts = [f"run {self.run}   {time.strftime('%H:%M:%S')}"]
        procs = self.processes()
        wv = latest_version(self.transport, self.names)
        if wv is None:
            parts.append("trainer: no version published yet")
        else:
            m = wv.metrics
            parts.append(
                f"trainer: version {wv.version} ({wv.kind.value}), step {wv.step}, samples trained "
                f"{wv.samples_trained}, reward {m.get('reward_mean', float('nan')):.3f}, version lag mean "
                f"{m.get('version_lag_mean', float('nan')):.2f} max {m.get('version_lag_max', float('nan')):.0f}, "
                f"broadcast {wv.broadcast_ms:.0f} ms, servers failed {len(wv.servers_failed)}"
            )
            parts.append(eval_line(latest_eval(self.transport, self.names)))
        if procs:
            rows: list[tuple[str, ...]] = [("process", "pid", "alive", "in/s", "out/s", "dlq")]
            for name, port in sorted(procs.get("metrics_ports", {}).items()):
                pid = procs.get("pids", {}).get(name)
                metrics = scrape(f"http://127.0.0.1:{port}/metrics") if port else None
                rows.append(
                    (
                        name,
                        str(pid or "-"),
                        "yes" if pid and pid_alive(pid) else "NO",
                        self._rate(name + ".in", metrics, "stream_rl_records_in_total"),
                        self._rate(name + ".out", metrics, "stream_rl_records_out_total"),
                        str(int((metrics or {}).get("stream_rl_dlq_records_total", 0))),
                    )
                )
            parts.append(table(rows))
        membership = self.membership(
            procs.get("servers") or self.servers, read_members(self.transport, self.names)
        )
        if membership:
            parts.append(table(self.server_rows(list(membership), wv, membership)))
        agg: dict[tuple[str, str], list[float]] = {}
        for x in run_lags(self.transport, self.names, with_age=True):
            entry = agg.setdefault((x.group.rsplit(".", 1)[-1], x.topic.rsplit(".", 1)[-1]), [0, 0])
            entry[0] += x.lag
            entry[1] = max(entry[1], x.oldest_age_s or 0.0)
        lag_rows: list[tuple[str, ...]] = [("group", "topic", "lag", "oldest unconsumed")]
        lag_rows += [
            (g, t, str(int(v[0])), f"{v[1]:.1f}s" if v[0] else "-") for (g, t), v in sorted(agg.items())
        ]
        parts.append(table(lag_rows))
        scaled = read_state(self.run_dir)
        if scaled is not None:
            parts.append("\n".join(status_lines(scaled)))
        return "\n\n".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", help="run name (default: the config's)")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--once", action="store_true", help="print once and exit")
    p.add_argument("--every", type=float, default=2.0, help="refresh period (s)")
    add_common(p)


def main(args: argparse.Namespace) -> int:
    from stream_rl.kafka.confluent import KafkaTransport

    cfg = load_config(args.config, args.overrides) if (args.config or args.overrides) else None
    run = args.run or (cfg.run if cfg else None)
    if not run:
        raise StreamRLError("which run? pass --run R (or --config)")
    run_dir = Path(args.runs_dir) / run
    if cfg is None and (run_dir / "config.yaml").is_file():
        # The launcher's resolved config: the run's prefix and Kafka client properties (secrets
        # are references there, read again from the environment or their files).
        cfg = load_config(run_dir / "config.yaml")
    procs = (
        json.loads((run_dir / "processes.json").read_text()) if (run_dir / "processes.json").exists() else {}
    )
    kcfg = cfg.kafka if cfg else KafkaConfig()
    bootstrap = resolve_bootstrap(args.bootstrap, kcfg.bootstrap or procs.get("bootstrap"), kcfg.data_dir)
    names = TopicNames(run=run, prefix=kcfg.prefix)
    kafka = KafkaTransport.for_run(kcfg, bootstrap)
    view = StatusView(run, run_dir, kafka, names, cfg.inference.server_urls() if cfg else ())
    if args.once:
        print(view.render())
        return 0
    try:
        while True:
            text = view.render()
            sys.stdout.write("\x1b[2J\x1b[H" + text + "\n")
            sys.stdout.flush()
            time.sleep(args.every)
    except KeyboardInterrupt:
        return 0
