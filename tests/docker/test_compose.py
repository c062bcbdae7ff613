"""`docker compose up` for real (marker `docker`): the test's own Docker engine
(deploy/docker/engine.sh: own data root in the cache, exec root, socket and pidfile, no iptables
rules), the images built from the Debian base deploy/docker/base.sh makes, the compose project of
docker-compose.yml with the secured overlay deploy/compose/secure.yml (SASL_SSL SCRAM-SHA-512 only,
the StandardAuthorizer, each stage on its own principal; `stream-rl kafka compose-secrets` writes its
material into a directory of the test's) plus tests/docker/compose.test.yml (an explicit subnet, the
cached model volume) brought up, and the CPU demo's run read from the host through Kafka's published
port, as the operator:

- the reward of what was sampled rises from <= 0.4 (first 3 versions) to >= 0.7 (last 3);
- `up -d --scale actor=3 --scale verifier=2` mid-run: every replica takes part and, once the run
  has drained, every scored sample is in `training-batches` exactly once (none lost, none twice);
- `docker compose run --rm lag-exporter status --config /etc/stream-rl/run.yaml --once` (the
  operator's container) shows the live run;
- each stage container holds only its own secret (its password and the CA under /run/secrets, its
  own config), and the actor's principal is refused WRITE on `training-batches` by the broker;
- the plaintext docker-compose.yml alone still validates (`docker compose config`, offline);
- Prometheus (Debian's, in its own image) scrapes every stage and the server;
- `down` then `up` keeps the topics and their records;
- after `down` and the engine's stop, the host's firewall rules, interfaces and forwarding are
  as they were.

Needs deploy/docker/install.sh's tools (`make test` runs it), root, `make setup`. Cold cache
(no base image, no layers, no model): ~15-25 min; warm: see docs/deploy.md "Docker".
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from compose_stack import (
    DEPLOY,
    Compose,
    Engine,
    Topics,
    host_network_state,
    left_behind,
    models_volume,
    sh,
    wait_for,
)

from stream_rl.config import load_config
from stream_rl.contracts import PartitionOffset, ScoredRollout, TrainingBatch
from stream_rl.errors import KafkaError
from stream_rl.kafka.compose_secrets import GRANTS, STAGE_ROLES
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.reader import read_to_end
from stream_rl.kafka.topics import RAW_ROLLOUTS, SCORED, TRAINING_BATCHES
from stream_rl.train.lineage import read_weight_versions

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]

CONFIG = load_config("configs/demo-docker.yaml")
RUN = CONFIG.run
STEPS = 50
"""The trainer's steps here (`--set trainer.max_steps`, compose.test.yml), not the demo's 100:
the sampled reward passes 0.7 by then (measured: ...), and every step costs the suite ~2 s of
both cores."""
SCALE_AT = STEPS // 4  # the version after which actors go 1 -> 3 and verifiers 1 -> 2
GROUP = CONFIG.actor.group_size


@dataclass
class DemoRun:
    """What the scenario saw; the tests below assert on it."""

    timings: dict[str, float] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)
    trainer_exit: str = ""
    scored: list[tuple[int, int, ScoredRollout]] = field(default_factory=list)
    """(partition, offset, record) of every `scored` record."""
    preprocessed: dict[int, int] = field(default_factory=dict)
    """The preprocessor group's committed offsets on `scored` at the end."""
    batches: list[TrainingBatch] = field(default_factory=list)
    trained_ids: list[str] = field(default_factory=list)
    actors: set[str] = field(default_factory=set)
    stages: list[dict[str, str]] = field(default_factory=list)
    status: str = ""
    prometheus_up: dict[str, int] = field(default_factory=dict)
    secrets: dict[str, tuple[str, set[str], set[str] | None]] = field(default_factory=dict)
    """Per container: its service, the files mounted under /run/secrets (docker inspect) and, for a
    running one, what `ls /run/secrets` shows inside it."""
    configs: dict[str, str] = field(default_factory=dict)
    """Per stage container: the host file mounted at /etc/stream-rl/run.yaml."""
    refused: str = ""
    """The broker's answer to the actor's principal writing `training-batches`."""


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(before=host_network_state())
    try:
        eng.up()
        yield eng
    finally:
        eng.down()


@pytest.fixture(scope="module")
def stack(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compose]:
    start = time.monotonic()
    bases = dict(
        line.split("=", 1) for line in sh([str(DEPLOY / "base.sh")], engine.env, timeout=1800).split()
    )
    compose = Compose(engine.env, bases, STEPS, tmp_path_factory.mktemp("compose-secrets"))
    compose.timings["base.sh and compose-secrets"] = time.monotonic() - start
    compose.docker("volume", "create", models_volume())
    compose("down", "-v", "--remove-orphans", check=False)  # an interrupted run's containers and topics
    try:
        yield compose
    finally:
        _take_down(compose)


def _take_down(compose: Compose) -> None:
    """Containers, network and the run's volumes; then what the cache need not keep: layers no
    image uses any more (older builds of the project) and the models of older code."""
    if compose.taken_down:
        return
    compose("down", "-v", "--remove-orphans", "--timeout", "30", check=False)
    compose.docker("image", "prune", "-f", check=False)
    for volume in compose.docker("volume", "ls", "-q", "--filter", "name=stream-rl-ci-models-").split():
        if volume != models_volume():
            compose.docker("volume", "rm", volume, check=False)
    compose.taken_down = True


def test_images_build_from_the_cached_base(stack: Compose) -> None:
    start = time.monotonic()
    stack("build")
    stack.timings["build"] = time.monotonic() - start

    def layers(image: str) -> list[str]:
        return json.loads(stack.docker("image", "inspect", "--format", "{{json .RootFS.Layers}}", image))

    for image, base in [
        ("stream-rl:latest", stack.env["STREAM_RL_PYTHON_BASE"]),
        ("stream-rl-kafka:4.3.1", stack.env["STREAM_RL_BASE"]),
        ("stream-rl-prometheus:latest", stack.env["STREAM_RL_BASE"]),
    ]:
        assert layers(image)[: len(layers(base))] == layers(base), f"{image} is not built on {base}"
    # The image runs the project's own code (editable install of /app).
    out = stack.docker("run", "--rm", "--network", "none", "stream-rl:latest", "topics", "--help")
    assert "apply" in out


def _versions(topics: Topics) -> list[int]:
    try:
        return [v.version for v in read_weight_versions(topics.kafka, topics.names, timeout_s=10)]
    except Exception:  # noqa: BLE001 - the topic does not exist before `init` ran
        return []


ROLES = {"trainer", "server", "preprocessor", "lag-exporter"}
"""The roles Prometheus scrapes besides the scaled actors and verifiers."""


def _every_role_up(up: dict[str, int]) -> bool:
    return up.get("actor", 0) >= 3 and up.get("verifier", 0) >= 2 and set(up) >= ROLES


def _prometheus_api(stack: Compose, path: str) -> Any:
    """The `data` of Prometheus's HTTP API answer at `path` (e.g. `query?query=up`)."""
    with urllib.request.urlopen(
        f"http://127.0.0.1:{stack.prometheus_port}/api/v1/{path}", timeout=10
    ) as resp:
        return json.load(resp)["data"]


def _down_targets(stack: Compose) -> list[str]:
    """Prometheus's own account of each target not up (its role, address and last scrape error)."""
    active = _prometheus_api(stack, "targets")["activeTargets"]
    return [
        f"{t['labels'].get('role')} {t['scrapeUrl']}: {t['health']} ({t.get('lastError') or 'no error'})"
        for t in active
        if t["health"] != "up"
    ]


SCRAPED = urllib.parse.quote("max_over_time(up[10m])")
"""Per target, 1 if one scrape of the last 10 minutes succeeded. Not `up` now: the trainer can
finish its steps during the wait on a slow machine (a cold CI run: its container gone, Prometheus
keeps scraping the address Docker's DNS last gave, "no route to host")."""


def _prometheus_up(stack: Compose) -> dict[str, int]:
    """Per role, the targets (replicas) Prometheus scraped at least once in the last 10 minutes."""
    result = _prometheus_api(stack, f"query?query={SCRAPED}")["result"]
    return dict(Counter(r["metric"]["role"] for r in result if r["value"][1] == "1"))


@pytest.fixture(scope="module")
def demo(stack: Compose, engine: Engine) -> DemoRun:
    out = DemoRun(timings=stack.timings)
    topics = Topics(stack.kafka, RUN)
    try:
        return _run_the_demo(stack, engine, topics, out)
    finally:
        topics.close()


def _run_the_demo(stack: Compose, engine: Engine, topics: Topics, out: DemoRun) -> DemoRun:
    start = time.monotonic()
    stack("up", "-d")
    engine.record_networks()
    wait_for("weight version 1", lambda: 1 in _versions(topics), timeout=900)
    out.timings["up to version 1"] = time.monotonic() - start
    wait_for(f"weight version {SCALE_AT}", lambda: SCALE_AT in _versions(topics), timeout=600)
    stack("up", "-d", "--scale", "actor=3", "--scale", "verifier=2")
    # While it trains: the live picture, and Prometheus scraping every replica.
    wait_for(
        "3 actors running",
        lambda: len([c for c in stack.containers("actor") if c["state"] == "running"]) == 3,
        120,
    )
    started = time.monotonic()
    out.status = stack(
        "run", "--rm", "lag-exporter", "status", "--config", "/etc/stream-rl/run.yaml", "--once", timeout=120
    )
    out.timings["compose run lag-exporter status"] = time.monotonic() - started
    _record_secrets(stack, out)  # every stage container there, the trainer still running
    # Every role (each replica) scraped: a busy stage can miss one 5 s scrape (seen: the trainer,
    # under a machine loaded ~7 times over), and the trainer may be done by now (_prometheus_up).
    seen: dict[str, int] = {}

    def every_role_up() -> dict[str, int] | None:
        seen.clear()
        seen.update(_prometheus_up(stack))
        return dict(seen) if _every_role_up(seen) else None

    try:
        out.prometheus_up = wait_for("Prometheus scraping every stage", every_role_up, timeout=120)
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}; the last query's up targets by role: {seen}; not up: {_down_targets(stack)}; "
            f"trainer containers: {stack.containers('trainer')}"
        ) from None
    wait_for(
        f"the trainer's exit after {STEPS} steps",
        lambda: all(c["state"] == "exited" for c in stack.containers("trainer")),
        timeout=900,
        every=5,
    )
    out.timings["up to the last version"] = time.monotonic() - start
    out.trainer_exit = stack.containers("trainer")[0]["exit"]
    out.versions = _versions(topics)

    # The run drains: groups in flight are finished and scored; the preprocessor packs what its
    # bound lets it (it holds once `max_lag`-many steps' worth of batches wait untrained, and the
    # trainer has stopped). Drained = nothing moves for 5 s and the verifiers have consumed all.
    def drained() -> bool:
        def snapshot() -> tuple[object, ...]:
            return (
                topics.end_offsets(RAW_ROLLOUTS),
                topics.end_offsets(SCORED),
                topics.end_offsets(TRAINING_BATCHES),
                topics.committed("preprocessor", SCORED),
            )

        before = snapshot()
        time.sleep(5)
        return before == snapshot() and topics.lag("verifier", RAW_ROLLOUTS) == 0

    wait_for("the run to drain", drained, timeout=300, every=1)
    out.preprocessed = topics.committed("preprocessor", SCORED)
    out.actors = {r.actor_id for r in topics.raw()}
    out.stages = [c for service in ("actor", "verifier", "preprocessor") for c in stack.containers(service)]
    out.scored = topics.scored_at()
    out.batches = topics.batches()
    final = read_weight_versions(topics.kafka, topics.names)[-1]
    out.trained_ids = _trained_ids(topics, final.consumed_offsets)
    out.refused = _actor_writes_training_batches(stack)
    return out


def _record_secrets(stack: Compose, out: DemoRun) -> None:
    for service in (*GRANTS, "server", "prometheus"):
        for c in stack.containers(service):
            mounts = json.loads(stack.docker("inspect", "--format", "{{json .Mounts}}", c["name"]))
            files = {m["Destination"].removeprefix("/run/secrets/") for m in mounts}
            inside = None
            if c["state"] == "running" and service in GRANTS:
                inside = _secrets_inside(stack, c["name"])
            out.secrets[c["name"]] = (service, {f for f in files if "/" not in f}, inside)
            config = [m["Source"] for m in mounts if m["Destination"] == "/etc/stream-rl/run.yaml"]
            if config:
                out.configs[c["name"]] = config[0]


def _secrets_inside(stack: Compose, name: str) -> set[str] | None:
    """`ls /run/secrets` in a running container; None when it stopped meanwhile (the trainer can
    finish its steps between the listing and the exec: seen in a clean-clone run, "Container ...
    is not running"). An exec into a container that is stopping fails with nothing on stderr while
    `inspect` still says running (seen in a suite run): it is asked again until it answers or the
    container is gone, and fails only if neither comes within 60 s."""
    failures: list[str] = []

    def answered() -> tuple[set[str] | None] | None:
        listed = subprocess.run(
            ["docker", "exec", name, "ls", "-A", "/run/secrets"],
            env=stack.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if listed.returncode == 0:
            return (set(listed.stdout.split()),)
        failures.append(f"exit {listed.returncode}: {listed.stderr.strip()!r}")
        state = stack.docker("inspect", "--format", "{{.State.Status}}", name).strip()
        return None if state == "running" else (None,)

    try:
        return wait_for(f"docker exec {name} ls /run/secrets", answered, timeout=60, every=1)[0]
    except AssertionError as e:
        raise AssertionError(f"{e}; while the container ran: {failures[-3:]}") from None


def _actor_writes_training_batches(stack: Compose) -> str:
    """The actor's own credentials (its principal, its password file) producing to `training-batches`
    from the host: the broker's refusal, as the client reports it (the operator's config with the
    actor's entry in place of the operator's)."""
    actor = stack.kafka.model_validate(
        {
            **stack.kafka.model_dump(),
            "credentials": {
                "actor": {
                    "client_properties": {"sasl.username": f"{RUN}-actor"},
                    "secret_properties": {"sasl.password": f"file:{stack.secrets / 'actor.password'}"},
                }
            },
        }
    ).for_role("actor")
    producer = KafkaTransport.for_config(actor, actor.bootstrap or "", outage_s=10).producer("break-in")
    producer.produce(Topics(stack.kafka, RUN).names[TRAINING_BATCHES], b"steer the gradients", key="k")
    try:
        producer.flush(timeout=30)
    except KafkaError as exc:
        return str(exc)
    return "written: the broker took the actor's write"


def _trained_ids(topics: Topics, consumed: list[PartitionOffset]) -> list[str]:
    """Sample ids of the micro-batches the trainer consumed (below its final offsets)."""
    topic = topics.names[TRAINING_BATCHES]
    ends = {(o.topic, o.partition): o.offset for o in consumed}
    return [
        s.rollout_id
        for m in read_to_end(topics.kafka, topic)
        if m.offset < ends.get((topic, m.partition), 0)
        for s in topics.serde.decode(m.value, TrainingBatch).samples
    ]


def _mean(values: list[float]) -> float:
    assert values, "no samples"
    return sum(values) / len(values)


def test_compose_up_learns(demo: DemoRun) -> None:
    assert demo.trainer_exit == "0"
    assert demo.versions == list(range(STEPS + 1))
    first = _mean([s.reward for _p, _o, s in demo.scored if s.rollout.version_spans[0].version <= 2])
    last = _mean([s.reward for _p, _o, s in demo.scored if s.rollout.version_spans[0].version >= STEPS - 3])
    print(f"\nreward of the sampled: first 3 versions {first:.3f}, last 3 {last:.3f}; timings {demo.timings}")
    assert first <= 0.4
    assert last >= 0.7


def test_scaled_stages_rebalance_and_every_sample_is_trained_exactly_once(demo: DemoRun) -> None:
    assert [c["state"] for c in demo.stages] == ["running"] * 6, demo.stages  # none died rebalancing
    assert len(demo.actors) == 3, demo.actors  # the first actor and the two added
    assert len({s.verifier_id for _p, _o, s in demo.scored}) == 2
    packed = Counter(s.rollout_id for b in demo.batches for s in b.samples)
    scored = {s.rollout.rollout_id: s for _p, _o, s in demo.scored}
    groups = Counter(s.rollout.group_id for s in scored.values())
    assert set(groups.values()) == {GROUP}, "every group scored whole"
    assert max(packed.values()) == 1, "a sample packed twice"
    assert set(packed) <= set(scored), "packed samples that were never scored"
    # None lost: every sample the preprocessor has consumed is packed, but for the groups that
    # still have a sample it has not consumed (it holds at its bound; they stay in the log).
    waiting = {s.rollout.group_id for p, o, s in demo.scored if o >= demo.preprocessed.get(p, 0)}
    consumed = {s.rollout.rollout_id for p, o, s in demo.scored if o < demo.preprocessed.get(p, 0)}
    lost = {i for i in consumed if scored[i].rollout.group_id not in waiting} - set(packed)
    assert not lost, f"{len(lost)} consumed samples never packed, e.g. {sorted(lost)[:3]}"
    trained = Counter(demo.trained_ids)
    assert len(trained) >= STEPS * CONFIG.trainer.samples_per_step
    assert max(trained.values()) == 1, "a sample trained twice"
    print(
        f"\n{len(scored)} samples scored ({len(demo.scored)} records), {sum(packed.values())} packed, "
        f"{len(groups) - len(waiting)} of {len(groups)} groups packed ({len(waiting)} wait at the "
        f"preprocessor's bound), {len(trained)} trained by version {STEPS}; actors {sorted(demo.actors)}"
    )


def test_each_stage_container_holds_only_its_own_secret(stack: Compose, demo: DemoRun) -> None:
    services = Counter(service for service, _files, _inside in demo.secrets.values())
    assert services["actor"] == 3 and services["verifier"] == 2 and services["kafka"] == 1, services
    for name, (service, files, inside) in demo.secrets.items():
        granted = set(GRANTS.get(service, ()))
        assert files == granted, f"{name}: /run/secrets holds {sorted(files)}, granted {sorted(granted)}"
        if inside is not None:
            assert inside == granted, f"{name}: ls /run/secrets shows {sorted(inside)}"
        if service in STAGE_ROLES:
            config = demo.configs[name]
            assert config.endswith(f"/{service}.yaml"), (name, config)
            text = (stack.secrets / f"{service}.yaml").read_text()
            others = [r for r in STAGE_ROLES if r != service]
            assert f"{RUN}-{service}" in text
            assert not [r for r in others if f"{RUN}-{r}" in text or f"{r}.password" in text], service
    for role in (*STAGE_ROLES, "operator"):  # by reference only: no password in any config
        password = (stack.secrets / f"{role}.password").read_text()
        assert not [p for p in stack.secrets.glob("*.yaml") if password in p.read_text()]


def test_the_broker_refuses_the_actor_writing_training_batches(demo: DemoRun) -> None:
    assert (
        f"Kafka refused User:{RUN}-actor WRITE on topic stream-rl.{RUN}.{TRAINING_BATCHES} "
        "(TOPIC_AUTHORIZATION_FAILED)" in demo.refused
    ), demo.refused
    assert "\n" not in demo.refused


def test_the_plaintext_compose_file_still_validates(stack: Compose) -> None:
    """The default docker-compose.yml alone (no overlay) is a valid project, and the overlay leaves
    the broker no PLAINTEXT listener (`docker compose config`: offline, no engine call)."""
    plain = ["docker", "compose", "-p", "plain", "-f", "docker-compose.yml", "config", "--format", "json"]
    env = {k: v for k, v in stack.env.items() if k != "STREAM_RL_COMPOSE_SECRETS"}
    kafka = json.loads(sh(plain, env))["services"]["kafka"]["environment"]
    assert "PLAINTEXT" in kafka["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]
    secured = [*plain[:6], "-f", "deploy/compose/secure.yml", *plain[6:]]
    kafka = json.loads(sh(secured, stack.env))["services"]["kafka"]["environment"]
    assert "PLAINTEXT" not in kafka["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"] + kafka["KAFKA_LISTENERS"]
    assert kafka["KAFKA_SUPER_USERS"] == "User:broker;User:operator"


def test_status_shows_the_live_picture(demo: DemoRun) -> None:
    assert f"run {RUN}" in demo.status
    assert "trainer: version" in demo.status and "reward" in demo.status
    for group in ("actor", "verifier", "preprocessor", "trainer"):
        assert any(line.split()[:1] == [group] for line in demo.status.splitlines()), demo.status


def test_prometheus_scrapes_every_stage(demo: DemoRun) -> None:
    up = demo.prometheus_up
    assert up.get("actor", 0) >= 3 and up.get("verifier", 0) >= 2, up
    assert set(up) >= ROLES, up


def test_down_then_up_keeps_the_topics(stack: Compose, demo: DemoRun) -> None:
    topics = Topics(stack.kafka, RUN)
    try:
        before = {t: topics.end_offsets(t) for t in (RAW_ROLLOUTS, SCORED)}
        stack("down", "--timeout", "30")
        assert not stack("ps", "-q")
        stack("up", "-d", "--wait", "kafka", timeout=300)
        assert {t: topics.end_offsets(t) for t in before} == before
        assert len(topics.scored()) == len(demo.scored)
        stack("down", "--timeout", "30")
    finally:
        topics.close()


def test_the_engine_leaves_nothing_behind(engine: Engine, stack: Compose) -> None:
    _take_down(stack)
    assert not stack("ps", "-a", "-q")
    engine.down()
    assert left_behind(engine.before, host_network_state()) == {}
