"""Several hosts on this machine: three network namespaces joined by veth pairs, a short pipeline
across them, every stage started by hand as on separate machines (docs/deploy.md "Several hosts").

    host A (10.231.1.1, 10.231.3.1): broker, loader, trainer
    host B (10.231.1.2): inference server, actor          A <-veth-> B
    host C (10.231.3.2): verifier, preprocessor           A <-veth-> C

B and C reach A's other address through A (their default route); B and C never talk. Each
namespace has its own loopback, as a host has, but no traffic between stages may use it: Kafka
advertises 10.231.1.1, the server binds 10.231.1.2, the trainer's weight-sync store is reached at
10.231.1.1 and gloo picks each side's address on that route. Kafka is secured as a cluster across
hosts would be: every stage reaches it over SASL/PLAIN on TLS (its keystore made here with the JDK's
`keytool`), the password given to each process as a `${ENV}` reference, never written into
`runs/` or a log; a client with a wrong password is refused in one line. The test creates the namespaces and
links itself and removes them (with every process it started) at the end; where the kernel or
the user cannot create them, it fails saying so, never skips. The outside view (`outside.py`, run
in namespace A: the root namespace has no link to them) checks versions 0..N, each pushed to the
server in B, and trained tokens sampled under those versions.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from chaos_checks import none_trained_twice, nothing_lost, within_lag_bound
from keystores import make_keystore

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TAG = f"{os.getpid() % 100000}"
NS = {h: f"srl{TAG}{h}" for h in "abc"}
A_TO_B, B_ADDR, A_TO_C, C_ADDR = "10.231.1.1", "10.231.1.2", "10.231.3.1", "10.231.3.2"
STEPS, GROUP = 8, 4
SCALE_AT, STOP_AT = 1, 5
"""At version SCALE_AT a second actor (in B) and a second verifier (in C) join their groups (the
trainer paused until they hold partitions: `_join`); at
STOP_AT the first of each is stopped (SIGTERM to its process group): static members, they do not
leave, so their partitions pass to the others when their session expires (docs/operations.md "Scaling during
a run"); the trainer's log times both."""
KAFKA_PORT, SASL_PORT, SERVER_PORT, SYNC_PORT = 9092, 9094, 8100, 29500
"""KAFKA_PORT: the broker's own PLAINTEXT listener, on A's loopback (its readiness probe and the
outside view, both run in A); SASL_PORT: the clients' listener, on 10.231.1.1."""
PASSWORD = "alice-" + uuid.uuid4().hex
PASSWORD_ENV = "SRL_HOSTS_KAFKA_PASSWORD"
SECURED_BROKER = """
import json, os, sys
from pathlib import Path
from stream_rl.kafka.broker import LocalBroker
from stream_rl.kafka.listener import SaslSslListener
spec = json.loads(os.environ["SRL_HOSTS_BROKER"])
listener = SaslSslListener(
    port=spec["sasl_port"], keystore=Path(spec["keystore"]), keystore_password=spec["store_password"],
    ca_pem=Path(spec["ca"]), users={"alice": spec["password"]},
)
LocalBroker(spec["dir"], port=spec["port"], host=spec["host"], listener=listener).up(quiet=True)
"""
"""Started in namespace A (`LocalBroker` with a SASL_SSL listener; `kafka up` has no flag for it)."""


def sh(*cmd: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")


def in_ns(host: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", NS[host], *cmd]


@pytest.fixture(scope="module")
def hosts() -> Iterator[dict[str, str]]:
    try:
        sh("ip", "netns", "add", NS["a"])
    except (AssertionError, FileNotFoundError) as exc:
        pytest.fail(f"cannot create a network namespace (this test needs root and `ip`): {exc}")
    made = [NS["a"]]
    try:
        for h in "bc":
            sh("ip", "netns", "add", NS[h])
            made.append(NS[h])
        for h in "abc":
            sh(*in_ns(h, "ip", "link", "set", "lo", "up"))
        for far, near_addr, far_addr in (("b", A_TO_B, B_ADDR), ("c", A_TO_C, C_ADDR)):
            near_if, far_if = f"v{TAG}a{far}", f"v{TAG}{far}a"
            sh(
                "ip",
                "link",
                "add",
                near_if,
                "netns",
                NS["a"],
                "type",
                "veth",
                "peer",
                "name",
                far_if,
                "netns",
                NS[far],
            )
            sh(*in_ns("a", "ip", "addr", "add", f"{near_addr}/24", "dev", near_if))
            sh(*in_ns("a", "ip", "link", "set", near_if, "up"))
            sh(*in_ns(far, "ip", "addr", "add", f"{far_addr}/24", "dev", far_if))
            sh(*in_ns(far, "ip", "link", "set", far_if, "up"))
            sh(*in_ns(far, "ip", "route", "add", "default", "via", near_addr))
        yield NS
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)  # its veth ends go too


class Procs:
    """The processes this test started (each in its own session: killed with its children)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, host: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - the child holds it
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PASSWORD_ENV: PASSWORD}
        proc = subprocess.Popen(
            in_ns(host, sys.executable, "-m", "stream_rl.cli", *args),
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.procs[name] = proc
        return proc

    def log(self, name: str, tail: int = 3000) -> str:
        """The end of a process's output (`tail` 0: all of it)."""
        return (self.logs / f"{name}.log").read_text(errors="replace")[-tail:]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _join(procs: Procs, trainer: subprocess.Popen[bytes], config: Path) -> str:
    """Start actor-1 (B) and verifier-1 (C) with the trainer paused (SIGSTOP: the run cannot end
    before they join; 25 s at most, within the trainer's 30 s session), until both have partitions."""
    os.kill(trainer.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        procs.start("actor-1", "b", "actor", "--config", str(config), "--instance", "1")
        procs.start("verifier-1", "c", "verifier", "--config", str(config), "--instance", "1")
        joined = {}
        while len(joined) < 2 and time.monotonic() - started < 25:
            for name in ("actor-1", "verifier-1"):
                if name not in joined and re.search(r"partitions \[\d", procs.log(name, 0)):
                    joined[name] = round(time.monotonic() - started, 1)
            time.sleep(0.2)
        return f"seconds from start to partitions assigned {joined}"
    finally:
        os.kill(trainer.pid, signal.SIGCONT)


def _healthy_in_b(url: str) -> bool:
    probe = f"import urllib.request; urllib.request.urlopen('{url}/health', timeout=2)"
    return subprocess.run(in_ns("b", sys.executable, "-c", probe), capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def across(hosts: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from stream_rl.inference.model_maker import make_model

    tmp = tmp_path_factory.mktemp("hosts")
    model = make_model(tmp / "tiny", "tiny", seed=0)
    run = f"hosts{TAG}"
    bootstrap, server = f"{A_TO_B}:{SASL_PORT}", f"http://{B_ADDR}:{SERVER_PORT}"
    store_password = uuid.uuid4().hex
    keystore, ca = make_keystore(tmp, store_password, sans=f"ip:{A_TO_B}")
    cfg = {
        "run": run,
        "runs_dir": str(tmp / "runs"),
        "model": {"path": str(model)},
        "kafka": {
            "bootstrap": bootstrap,
            "partitions": 2,
            "client_properties": {
                "security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.username": "alice",
                "ssl.ca.location": str(ca),
            },
            "secret_properties": {"sasl.password": f"${{{PASSWORD_ENV}}}"},
            # A stopped static member's partitions wait out its session, max(30 s, this): 120 s at
            # the default (measured here: the run stood still for 121 s after the stop).
            "outage_timeout_s": 30,
        },
        "task": {"name": "arithmetic", "params": {"num_problems": 64}},
        "inference": {"num_servers": 0, "servers": [{"url": server}]},
        "actor": {"group_size": GROUP, "max_lag": 1, "sampling": {"max_tokens": 4}},
        "trainer": {
            "samples_per_step": 16, "max_steps": STEPS, "bucket_mb": 1,
            "sync_master_addr": A_TO_B, "sync_master_port": SYNC_PORT,
        },
    }  # fmt: skip
    config = tmp / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    procs = Procs(tmp)
    kafka_dir = str(tmp / "kafka")
    try:
        spec = {
            "dir": kafka_dir, "port": KAFKA_PORT, "host": A_TO_B, "sasl_port": SASL_PORT,
            "keystore": str(keystore), "ca": str(ca), "store_password": store_password, "password": PASSWORD,
        }  # fmt: skip
        up = subprocess.run(
            in_ns("a", sys.executable, "-c", SECURED_BROKER),
            cwd=REPO, capture_output=True, text=True, timeout=120,
            env={**os.environ, "SRL_HOSTS_BROKER": json.dumps(spec)},
        )  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
        apply = in_ns("c", sys.executable, "-m", "stream_rl.cli", "topics", "apply", "--config", str(config))
        wrong = subprocess.run(
            apply,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, PASSWORD_ENV: "wrong"},
        )
        topics = subprocess.run(
            apply,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, PASSWORD_ENV: PASSWORD},
        )
        assert topics.returncode == 0, topics.stdout + topics.stderr
        procs.start(
            "server", "b", "serve", "--model", str(model), "--host", B_ADDR, "--port", str(SERVER_PORT)
        )
        deadline = time.monotonic() + 120
        while not _healthy_in_b(server):
            assert procs.procs["server"].poll() is None, procs.log("server")
            assert time.monotonic() < deadline, "the server in B did not become healthy: " + procs.log(
                "server"
            )
            time.sleep(1)
        trainer = procs.start("trainer", "a", "trainer", "--config", str(config), "--max-steps", str(STEPS))
        procs.start("loader", "a", "loader", "--config", str(config))
        procs.start("actor-0", "b", "actor", "--config", str(config), "--instance", "0")
        procs.start("verifier-0", "c", "verifier", "--config", str(config), "--instance", "0")
        procs.start("preprocessor", "c", "preprocessor", "--config", str(config))
        scaled: list[str] = []
        deadline = time.monotonic() + 300
        while trainer.poll() is None and time.monotonic() < deadline:
            version = max(
                (int(v) for v in re.findall(r"version (\d+): ", procs.log("trainer", 0))), default=0
            )
            if version >= SCALE_AT and not scaled:
                scaled.append(f"added actor-1, verifier-1@{version}: {_join(procs, trainer, config)}")
            if version >= STOP_AT and len(scaled) == 1:
                for name in ("actor-0", "verifier-0"):
                    os.killpg(procs.procs[name].pid, signal.SIGTERM)
                scaled.append(f"stopped actor-0, verifier-0@{version}")
            time.sleep(0.5)
        rc = trainer.poll()
        stopped_rc = {}
        if len(scaled) == 2:
            for name in ("actor-0", "verifier-0"):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    stopped_rc[name] = procs.procs[name].wait(30)
        logs = {name: procs.log(name) for name in procs.procs}
        assert rc == 0, f"trainer rc {rc}:\n" + "\n".join(f"--- {n}\n{t}" for n, t in logs.items())
        dump = subprocess.run(
            in_ns("a", sys.executable, str(Path(__file__).with_name("chaos_checks.py")), f"127.0.0.1:{KAFKA_PORT}", run),
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert dump.returncode == 0, dump.stderr
        written = [p for p in (tmp / "runs").rglob("*") if p.is_file()] + list(tmp.glob("*.log"))
        leaked = [str(p) for p in written if PASSWORD.encode() in p.read_bytes()]
        yield {
            "server": server, "logs": logs, "wrong": wrong, "written": written, "leaked": leaked,
            "scaled": scaled, "stopped_rc": stopped_rc, **json.loads(dump.stdout),
        }  # fmt: skip
    finally:
        procs.stop()
        subprocess.run(
            in_ns("a", sys.executable, "-m", "stream_rl.cli", "kafka", "down", "--quiet", "--data-dir", kafka_dir),
            cwd=REPO, capture_output=True, timeout=60,
        )  # fmt: skip


def _connects(host: str, addr: str, port: int) -> bool:
    """A TCP connection from namespace `host` to addr:port succeeds."""
    probe = f"import socket; socket.create_connection(('{addr}', {port}), timeout=2).close()"
    return subprocess.run(in_ns(host, sys.executable, "-c", probe), capture_output=True).returncode == 0


def test_the_namespaces_reach_each_other_only_through_their_links(hosts: dict[str, str]) -> None:
    listen = "import socket, time; s = socket.create_server(('0.0.0.0', 7007)); time.sleep(60)"
    listeners = [subprocess.Popen(in_ns(h, sys.executable, "-c", listen)) for h in "ac"]
    try:
        time.sleep(1.5)
        assert _connects("c", A_TO_B, 7007), "C reaches A's address on the A-B link through A"
        assert _connects("b", A_TO_B, 7007)
        assert not _connects("b", C_ADDR, 7007), "A routes nothing between B and C"
    finally:
        for p in listeners:
            p.kill()
            p.wait()


def test_a_pipeline_across_three_hosts_trains_and_pushes_weights_between_them(across: dict[str, Any]) -> None:
    versions = {v["version"]: v for v in across["weight-versions"]}
    assert sorted(versions) == list(range(STEPS + 1))
    # Every update was installed on the server in B over gloo from the trainer in A.
    assert all(versions[v]["servers_updated"] == [across["server"]] for v in range(1, STEPS + 1))
    assert not any(versions[v]["servers_failed"] for v in versions)
    spans = [
        sp["version"]
        for _p, _o, b in across["training-batches"]
        if b
        for s in b["samples"]
        for sp in s["version_spans"]
    ]
    assert spans and set(spans) <= set(versions)
    assert max(spans) >= 1, "samples generated after the first push carry its version"


def test_consumers_added_and_stopped_during_the_run_lose_and_repeat_nothing(across: dict[str, Any]) -> None:
    assert len(across["scaled"]) == 2, across["scaled"]
    print(across["scaled"])
    assert "'actor-1'" in across["scaled"][0] and "'verifier-1'" in across["scaled"][0], across["scaled"]
    assert across["stopped_rc"] == {"actor-0": 0, "verifier-0": 0}, "SIGTERM is a clean stop"
    actors = {r["actor_id"] for _p, _o, r in across["raw-rollouts"]}
    verifiers = {s["verifier_id"] for _p, _o, s in across["scored"]}
    assert actors == {"actor-0", "actor-1"} and verifiers == {"verifier-0", "verifier-1"}
    nothing_lost(across, GROUP)
    none_trained_twice(across, GROUP, at_least=STEPS * 16)
    within_lag_bound(across, 1)


def test_kafka_across_hosts_takes_credentials_and_keeps_them_secret(across: dict[str, Any]) -> None:
    wrong = across["wrong"]
    assert isinstance(wrong, subprocess.CompletedProcess)
    assert wrong.returncode == 2
    err = wrong.stderr.strip().splitlines()
    assert len(err) == 1 and "refused our credentials" in err[0], wrong.stderr
    assert across["written"], "the stages wrote their run directories"
    assert across["leaked"] == [], "the password reached a file"
