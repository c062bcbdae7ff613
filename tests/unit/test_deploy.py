"""The Docker path, checked without Docker (tests/docker/ runs it for real): docker-compose.yml
parses, every stream-rl service runs a real `stream-rl` subcommand whose arguments parse with that
command's own parser and whose `--config` loads, the services agree with configs/demo-docker.yaml
and the Prometheus config (hostnames, ports, paths), the images default to public bases, the
Dockerfiles copy what exists, the stream-rl Dockerfile installs exactly what the README's "Install
without make" says, and the Kafka image's entry point turns the compose file's KAFKA_* variables
into the broker's properties. Plus: `--instance` takes a replica's hostname."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from fakes.records import make_scored_groups

from stream_rl.cli import COMMANDS, command_parser
from stream_rl.config import RunConfig, load_config
from stream_rl.contracts import TrainingBatch
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.kafka.serde import default_serde
from stream_rl.kafka.topics import SCORED, TRAINING_BATCHES, TopicNames
from stream_rl.stages import preprocessor
from stream_rl.stages.entry import instance_id

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
COMPOSE: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
DOCKERFILE = (REPO / "deploy" / "Dockerfile").read_text()
HOSTNAME = "3f2a9c1b7d10"  # what $HOSTNAME is in a container: its short id
SCALED = ("actor", "verifier", "preprocessor")


def dockerfile_instructions(keyword: str) -> list[str]:
    return [
        line[len(keyword) + 1 :].strip() for line in DOCKERFILE.splitlines() if line.startswith(keyword + " ")
    ]


def stream_rl_services() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in SERVICES.items() if svc.get("image") == "stream-rl:latest"}


def invocations(svc: dict[str, Any]) -> list[list[str]]:
    """The `stream-rl` argv lists a service runs (after `stream-rl`), with $$HOSTNAME substituted."""
    command = svc.get("command", [])
    entrypoint = svc.get("entrypoint")
    if entrypoint is None:
        entry = json.loads(dockerfile_instructions("ENTRYPOINT")[0])
        assert entry == ["stream-rl"]
        return [[str(c) for c in command]]
    assert entrypoint == ["sh", "-c"], f"unexpected entrypoint {entrypoint}"
    script = " ".join(command).replace("$$HOSTNAME", HOSTNAME)
    assert "$" not in script, f"compose would interpolate a variable from the host: {script}"
    out = []
    for part in re.split(r"&&|\|\||;|\(|\)", script):
        words = shlex.split(part)
        if words and words[0] == "exec":
            words = words[1:]
        if words and words[0] == "stream-rl":
            out.append(words[1:])
    return out


def parse(argv: list[str]) -> tuple[str, argparse.Namespace]:
    name = argv[0]
    assert name in {n for n, _, _ in COMMANDS}, f"`stream-rl {name}` is not a command"
    parser, _ = command_parser(name)
    return name, parser.parse_args(argv[1:])


ALL = [(svc, argv) for svc, spec in stream_rl_services().items() for argv in invocations(spec)]


def test_compose_parses_and_every_stream_rl_service_runs_a_command() -> None:
    services = stream_rl_services()
    assert set(services) >= {"init", "server", "trainer", "loader", *SCALED, "lag-exporter"}
    assert all(invocations(spec) for spec in services.values())
    assert {"kafka", "prometheus", "grafana"} <= set(SERVICES)
    # One service builds the image the others run (so `up` builds it once, and pulls nothing).
    assert [n for n, svc in services.items() if "build" in svc] == ["init"]
    assert SERVICES["grafana"]["profiles"] == ["grafana"], "Grafana is unverified: opt-in only"


def test_images_default_to_public_bases() -> None:
    """BASE selects the base image; without the variables base.sh prints, public images are used."""
    expected = {
        "init": ("deploy/Dockerfile", "STREAM_RL_PYTHON_BASE", "python:3.11-slim"),
        "kafka": ("docker/kafka.Dockerfile", "STREAM_RL_BASE", "debian:bookworm-slim"),
        "prometheus": ("docker/prometheus.Dockerfile", "STREAM_RL_BASE", "debian:bookworm-slim"),
    }
    for service, (dockerfile, variable, default) in expected.items():
        build = SERVICES[service]["build"]
        assert build["dockerfile"] == dockerfile
        assert build["args"]["BASE"] == f"${{{variable}:-{default}}}"
        text = (REPO / build["context"] / dockerfile).read_text()
        assert f"ARG BASE={default}\nFROM ${{BASE}}" in text, f"{dockerfile} defaults to {default}"


@pytest.mark.parametrize("service,argv", ALL, ids=[f"{s}:{a[0]}" for s, a in ALL])
def test_service_arguments_parse_and_config_loads(service: str, argv: list[str]) -> None:
    _, args = parse(argv)
    config = getattr(args, "config", None)
    if config is not None:
        assert not Path(config).is_absolute(), "configs come from the image's /app (the repository)"
        assert isinstance(load_config(REPO / config, args.overrides), RunConfig)


def demo_config() -> RunConfig:
    return load_config(REPO / "configs" / "demo-docker.yaml")


def args_of(service: str, command: str) -> argparse.Namespace:
    argv = next(a for a in invocations(SERVICES[service]) if a[0] == command)
    return parse(argv)[1]


def test_scaled_services_take_the_hostname_as_instance_and_the_trainer_stays_single() -> None:
    for name in SCALED:
        args = args_of(name, name)
        assert args.instance == HOSTNAME
    assert "--instance" not in invocations(SERVICES["trainer"])[0]
    assert args_of("trainer", "trainer").instance == "0"  # the shared stage entry: --instance is an id
    assert "deploy" not in SERVICES["trainer"]  # no replicas


def test_services_agree_with_the_docker_config() -> None:
    cfg = demo_config()
    env = SERVICES["trainer"]["environment"]
    assert cfg.kafka.bootstrap == env["STREAM_RL_KAFKA_BOOTSTRAP"] == "kafka:19092"
    assert "PLAINTEXT://kafka:19092" in SERVICES["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    # The actor reaches the server service at its port; the server the trainer's store by its hostname.
    (server,) = cfg.inference.servers
    url = urlparse(server.url)
    serve = args_of("server", "serve")
    assert url.hostname in SERVICES and (url.port, serve.host) == (serve.port, "0.0.0.0")
    assert cfg.trainer.sync_master_addr in SERVICES and cfg.trainer.sync_master_addr == "trainer"
    # One model path: built by init, served, trained; on the shared volume.
    make_model = args_of("init", "make-model")
    assert cfg.model.path == serve.model == "/models/tiny-arith"
    # Made aside and renamed when complete, so an interrupted `init` does not leave half a model.
    init_script = " ".join(SERVICES["init"]["command"])
    assert f"test -d {cfg.model.path} ||" in init_script
    assert f"mv {make_model.out} {cfg.model.path}" in init_script
    assert make_model.warm_start == "arithmetic"
    assert any(v.endswith(":/models") for v in SERVICES["server"]["volumes"])
    assert args_of("init", "topics").action == "apply"
    assert SERVICES["server"]["environment"]["STREAM_RL_METRICS_HOST"] == "0.0.0.0"


def test_prometheus_scrapes_what_the_services_serve() -> None:
    prom = yaml.safe_load((REPO / "deploy" / "prometheus-docker.yml").read_text())
    ports: dict[str, int] = {}
    for job in prom["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            for name in sd["names"]:
                ports[name] = sd["port"]
    assert set(ports) <= set(SERVICES)
    for name, port in ports.items():
        args = next(parse(a)[1] for a in invocations(SERVICES[name]))
        served = getattr(args, "metrics_port", None) or getattr(args, "serve_metrics", None) or args.port
        assert served == port, f"{name} serves /metrics on {served}, prometheus scrapes {port}"
    assert {"trainer", "server", "lag-exporter", *SCALED} <= set(ports)


def test_bind_mounts_exist() -> None:
    for name, svc in SERVICES.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), f"{name} mounts {source}, which does not exist"
    grafana = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (REPO / "deploy" / "grafana" / "dashboards" / Path(grafana).name).is_file()


@pytest.mark.parametrize("service", ["kafka", "prometheus"])
def test_deploy_context_dockerfiles_copy_what_exists(service: str) -> None:
    build = SERVICES[service]["build"]
    context = REPO / build["context"]
    for line in (context / build["dockerfile"]).read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (context / source).exists(), (
                    f"{build['dockerfile']} copies {source}, which does not exist"
                )


def test_kafka_entry_point_turns_the_compose_variables_into_properties(tmp_path: Path) -> None:
    """deploy/docker/kafka-run.sh with the kafka service's environment and a `java` that records
    its arguments: the properties are the KAFKA_* variables by the apache/kafka image's rule, the
    storage is formatted once with CLUSTER_ID, and the broker gets the class path unexpanded."""
    (tmp_path / "config").mkdir()
    (tmp_path / "libs").mkdir()
    (tmp_path / "libs" / "a.jar").touch()
    (tmp_path / "bin").mkdir()
    java = tmp_path / "bin" / "java"
    java.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/java.log\n')
    java.chmod(0o755)
    env = {k: str(v) for k, v in SERVICES["kafka"]["environment"].items()}
    env["KAFKA_LOG_DIRS"] = str(tmp_path / "data")
    env["KAFKA_ADVERTISED_LISTENERS"] = env["KAFKA_ADVERTISED_LISTENERS"].replace(
        "${STREAM_RL_KAFKA_PORT:-9092}", "9092"
    )
    env |= {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "STREAM_RL_KAFKA_HOME": str(tmp_path)}
    script = REPO / "deploy" / "docker" / "kafka-run.sh"
    subprocess.run([str(script)], env=env, check=True, timeout=30)
    props = dict(
        line.split("=", 1) for line in (tmp_path / "config" / "server.properties").read_text().splitlines()
    )
    assert props["process.roles"] == "broker,controller"
    assert props["listener.security.protocol.map"] == env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]
    assert props["transaction.abort.timed.out.transaction.cleanup.interval.ms"] == "5000"
    assert props["log.dirs"] == str(tmp_path / "data")
    assert "heap.opts" not in props and "cluster.id" not in props
    jvm = ("KAFKA_HEAP_OPTS", "KAFKA_OPTS")
    assert len(props) == len([k for k in env if k.startswith("KAFKA_") and k not in jvm])
    fmt, start = (tmp_path / "java.log").read_text().splitlines()
    assert "kafka.tools.StorageTool format --cluster-id=4L6g3nShT-eMCtK--X86sw" in fmt
    assert start.split()[:2] == ["-Xms256m", "-Xmx768m"]
    assert f"-cp {tmp_path}/libs/* kafka.Kafka {tmp_path}/config/server.properties" in start
    assert "-XX:TieredStopAtLevel=1" in start.split(), "the compose broker runs C1 only, as the local one"
    # Formatted storage is not formatted again.
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.properties").touch()
    subprocess.run([str(script)], env=env, check=True, timeout=30)
    assert len((tmp_path / "java.log").read_text().splitlines()) == 3


def test_dockerfile_copies_what_exists_and_installs_the_readme_steps() -> None:
    for copy in dockerfile_instructions("COPY"):
        for source in copy.split()[:-1]:
            assert (REPO / source).exists(), f"Dockerfile copies {source}, which does not exist"
    docker_pips = [run for run in dockerfile_instructions("RUN") if run.startswith("pip install")]
    readme = (REPO / "README.md").read_text()
    section = readme.split("### Install without make", 1)[1].split("\n#", 1)[0]
    readme_pips = [line.strip() for line in section.splitlines() if line.strip().startswith("pip install")]
    assert docker_pips and docker_pips == readme_pips
    # The CPU torch wheel is the version pyproject.toml pins.
    pinned = re.search(r'"torch==([^"]+)"', (REPO / "pyproject.toml").read_text())
    assert pinned and f"torch=={pinned.group(1)} " in docker_pips[0]


@pytest.mark.parametrize("value", ["0", "12", HOSTNAME, "actor-2.example"])
def test_instance_ids_accept_hostnames(value: str) -> None:
    assert instance_id(value) == value


@pytest.mark.parametrize("value", ["", "a b", "-x", "x/y", "é", "x" * 65])
def test_instance_ids_reject_what_kafka_ids_should_not_hold(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        instance_id(value)


def test_a_hostname_instance_names_the_preprocessor_s_output() -> None:
    names = TopicNames("r")
    transport = MemoryTransport()
    transport.create_topics(names.all_topics(partitions=2))
    producer = transport.producer("verifier")
    for s in make_scored_groups([[1, 0, 0, 1]], run_id="r"):
        producer.produce(names[SCORED], default_serde().encode(s), key=s.rollout.group_id)
    config = RunConfig.model_validate({"run": "r"})
    stats = preprocessor.run(config, transport=transport, max_records=4, instance=HOSTNAME)
    assert stats.records_in == 4
    batches = [
        default_serde().decode(m.value, TrainingBatch) for m in transport.messages(names[TRAINING_BATCHES])
    ]
    assert batches and {b.producer_id for b in batches} == {f"preprocessor-{HOSTNAME}"}


def test_metrics_bind_where_the_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers set $STREAM_RL_METRICS_HOST=0.0.0.0; here 127.0.0.2 tells the two apart."""
    import socket

    from stream_rl.common.metrics import METRICS_HOST_ENV, serve_metrics

    monkeypatch.setenv(METRICS_HOST_ENV, "127.0.0.2")
    port = serve_metrics(0)
    with socket.create_connection(("127.0.0.2", port), timeout=5):
        pass
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
