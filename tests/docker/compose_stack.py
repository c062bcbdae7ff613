"""Helpers of the compose test: the test's own Docker engine (deploy/docker/engine.sh with a run
dir of its own), `docker compose` on the project with the secured overlay (deploy/compose/secure.yml,
its material written by `stream-rl kafka compose-secrets` into a directory of the test's) and the
test's override file, the host's network state (to prove the engine leaves none behind) and readers
of the run's topics from the host through Kafka's published port, as the operator."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from stream_rl.common.ports import free_port
from stream_rl.config import KafkaConfig, load_config
from stream_rl.contracts import Rollout, ScoredRollout, TrainingBatch
from stream_rl.kafka.compose_secrets import write_compose_secrets
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.lag import partition_lags
from stream_rl.kafka.reader import read_to_end
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import RAW_ROLLOUTS, SCORED, TRAINING_BATCHES, TopicNames

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "docker"
PROJECT = "stream-rl-ci"
SUBNET = "10.213.250.0/24"  # inside engine.sh's default address pool, 10.213.0.0/16
# The code that makes the demo model: the models volume is rebuilt when it changes.
MODEL_CODE = [
    "stream_rl/inference/model_maker.py",
    "stream_rl/tools/warm_start.py",
    "stream_rl/tasks/arithmetic.py",
]

T = TypeVar("T")


def sh(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 600, check: bool = True) -> str:
    """Run a command; return stdout; on failure raise with its output (stderr included)."""
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc.stdout


def host_network_state() -> dict[str, set[str]]:
    """What a Docker engine could leave on the host: firewall rules, interfaces, forwarding."""
    links = sh(["ip", "-o", "link", "show"])
    return {
        "iptables": set(sh(["iptables", "-S"]).splitlines()),
        "iptables nat": set(sh(["iptables", "-t", "nat", "-S"]).splitlines()),
        "ip6tables": set(sh(["ip6tables", "-S"]).splitlines()),
        "interfaces": {m.group(1) for m in re.finditer(r"^\d+: ([^:@]+)", links, re.M)},
        "ip_forward": {Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()},
    }


def left_behind(before: dict[str, set[str]], after: dict[str, set[str]]) -> dict[str, list[str]]:
    """What `after` has that `before` had not. Not equality: an engine starting on the shared data
    root removes what a killed earlier one left (its bridge and veths), so `before` may hold more."""
    return {key: sorted(after[key] - before[key]) for key in before if after[key] - before[key]}


def models_volume() -> str:
    digest = hashlib.sha256()
    for path in MODEL_CODE:
        digest.update((REPO / path).read_bytes())
    return f"stream-rl-ci-models-{digest.hexdigest()[:12]}"


@dataclass
class Engine:
    """The test's own dockerd: `up` starts it (waiting while another stream-rl engine holds the
    shared data root), `down` stops it by its pid and removes what it made."""

    before: dict[str, set[str]]
    """host_network_state() before the engine started."""
    run_dir: str = field(default_factory=lambda: f"/run/stream-rl-docker-test-{os.getpid()}")
    env: dict[str, str] = field(default_factory=dict)

    def up(self) -> dict[str, str]:
        self.env = {**os.environ, "STREAM_RL_DOCKER_RUN": self.run_dir}
        for line in sh([str(DEPLOY / "engine.sh"), "up"], self.env, timeout=1200).splitlines():
            name, _, value = line.removeprefix("export ").partition("=")
            self.env[name] = value
        return self.env

    def down(self) -> None:
        sh([str(DEPLOY / "engine.sh"), "down"], self.env, timeout=180)

    def record_networks(self) -> None:
        sh([str(DEPLOY / "engine.sh"), "record-networks"], self.env)


class Compose:
    """`docker compose` on the project, with the test's override file and variables."""

    def __init__(self, env: dict[str, str], bases: dict[str, str], steps: int, secrets: Path) -> None:
        self.timings: dict[str, float] = {}
        self.taken_down = False
        self.kafka_port = free_port()
        self.prometheus_port = free_port()
        self.env = {
            **env,
            **bases,
            "STREAM_RL_KAFKA_PORT": str(self.kafka_port),
            "STREAM_RL_PROMETHEUS_PORT": str(self.prometheus_port),
            "STREAM_RL_TEST_SUBNET": SUBNET,
            "STREAM_RL_TEST_MODELS_VOLUME": models_volume(),
            "STREAM_RL_TEST_STEPS": str(steps),
            "STREAM_RL_COMPOSE_SECRETS": str(secrets),
        }
        self.secrets = write_compose_secrets(
            REPO / "configs" / "demo-docker.yaml", secrets, host_port=self.kafka_port
        ).out
        self.kafka: KafkaConfig = load_config(self.secrets / "host.yaml").kafka
        """The operator's, for the host's tools (localhost:kafka_port, the CA and password files)."""

    @property
    def bootstrap(self) -> str:
        return f"localhost:{self.kafka_port}"

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> str:
        base = [
            "docker",
            "compose",
            "-p",
            PROJECT,
            "-f",
            "docker-compose.yml",
            "-f",
            "deploy/compose/secure.yml",
            "-f",
            "tests/docker/compose.test.yml",
        ]
        return sh([*base, *args], self.env, timeout=timeout, check=check)

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        return sh(["docker", *args], self.env, timeout=timeout, check=check)

    def containers(self, service: str) -> list[dict[str, str]]:
        """State and exit code of every container of a service (running or not)."""
        out = self("ps", "-a", "--format", "{{.Name}} {{.State}} {{.ExitCode}}", service)
        return [
            dict(zip(("name", "state", "exit"), line.split(), strict=True))
            for line in out.splitlines()
            if line
        ]


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, every: float = 2.0) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


class Topics:
    """The run's topics, read from the host (a consumer outside any group), as `kafka`'s operator."""

    def __init__(self, kafka: KafkaConfig, run: str) -> None:
        self.kafka = KafkaTransport.for_config(kafka, kafka.bootstrap or "")
        self.names = TopicNames(run=run)
        self.serde = default_serde()

    def _read(self, topic: str, cls: type[Any]) -> list[Any]:
        return [
            self.serde.decode(m.value, cls) for m in read_to_end(self.kafka, self.names[topic], timeout_s=120)
        ]

    def raw(self) -> list[Rollout]:
        return self._read(RAW_ROLLOUTS, Rollout)

    def scored(self) -> list[ScoredRollout]:
        return self._read(SCORED, ScoredRollout)

    def scored_at(self) -> list[tuple[int, int, ScoredRollout]]:
        """(partition, offset, record) of every `scored` record."""
        return [
            (m.partition, m.offset, self.serde.decode(m.value, ScoredRollout))
            for m in read_to_end(self.kafka, self.names[SCORED], timeout_s=120)
        ]

    def committed(self, role: str, topic: str) -> dict[int, int]:
        """The role's consumer group's committed offsets on `topic` (-1 where none)."""
        return dict(self.kafka.group_offsets(self.names.group(role), self.names[topic]))

    def batches(self) -> list[TrainingBatch]:
        return self._read(TRAINING_BATCHES, TrainingBatch)

    def close(self) -> None:
        """Drop the admin client, whose librdkafka handle would otherwise retry a broker that is
        gone for as long as the test process lives (an error's traceback keeps this object)."""
        self.kafka._admin = None

    def end_offsets(self, topic: str) -> int:
        return sum(high for _low, high in self.kafka.watermarks(self.names[topic]).values())

    def lag(self, role: str, topic: str) -> int:
        return sum(
            x.lag for x in partition_lags(self.kafka, self.names.group(role), self.names[topic], False)
        )
