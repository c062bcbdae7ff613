"""deploy/k8s/ checked offline (it has never been applied to a cluster: docs/deploy.md "Kubernetes").

Every object parses; every built-in kind validates strictly against the Kubernetes API's JSON
schemas (kubernetes-validate: unknown fields, wrong types and missing required fields fail); the
Strimzi and KEDA custom resources, which those schemas do not cover, are checked for the fields
stream-rl relies on. And the manifests agree with the run config they mount and with the code:
topics with the topology, consumer groups and topics of the KEDA triggers with the run's names,
server URLs with the StatefulSet, the trainer's weight-sync address with its Service, every
container's arguments with its command's own parser, every path the config names with a mount."""

from __future__ import annotations

import shlex
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from stream_rl.cli import command_parser
from stream_rl.config import RunConfig
from stream_rl.kafka.topics import TopicNames, load_topology

pytestmark = pytest.mark.unit

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
K8S_VERSION = "1.35.0"  # the schema set of kubernetes-validate (pinned in pyproject.toml)
BUILTIN = {"v1", "apps/v1", "batch/v1"}
CUSTOM = {
    ("kafka.strimzi.io/v1beta2", "Kafka"),
    ("kafka.strimzi.io/v1beta2", "KafkaNodePool"),
    ("kafka.strimzi.io/v1beta2", "KafkaTopic"),
    ("kafka.strimzi.io/v1beta2", "KafkaUser"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("keda.sh/v1alpha1", "TriggerAuthentication"),
}
POD_NAME = "stream-rl-actor-0"  # what $(POD_NAME) expands to in a StatefulSet's first pod


@cache
def objects() -> tuple[dict[str, Any], ...]:
    files = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    return tuple(d for f in files for d in yaml.safe_load_all((K8S / f).read_text()) if d is not None)


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects() if o["kind"] == kind}


@cache
def run_config() -> RunConfig:
    return RunConfig.model_validate(yaml.safe_load(by_kind("ConfigMap")["stream-rl-run"]["data"]["run.yaml"]))


def pod_specs() -> dict[str, dict[str, Any]]:
    kinds = ("StatefulSet", "Deployment", "Job")
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects() if o["kind"] in kinds}


def test_every_file_is_listed_and_every_object_is_known() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    names = [(o["kind"], o["metadata"]["name"]) for o in objects()]
    assert len(names) == len(set(names)), "two objects share a kind and name"
    for o in objects():
        assert o["apiVersion"] in BUILTIN or (o["apiVersion"], o["kind"]) in CUSTOM, o["kind"]


@pytest.mark.parametrize(
    "obj",
    [o for o in objects() if o["apiVersion"] in BUILTIN],
    ids=lambda o: f"{o['kind']}/{o['metadata']['name']}",
)
def test_builtin_objects_match_the_kubernetes_api(obj: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_validator_refuses_an_unknown_field() -> None:
    import kubernetes_validate

    sts = dict(by_kind("StatefulSet")["stream-rl-server"])
    sts["spec"] = {**sts["spec"], "replica": 2}
    # Caught by hand and read by .message: pytest.raises renders the exception, hence the whole
    # schema (half a second).
    message = ""
    try:
        kubernetes_validate.validate(sts, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        message = exc.message
    assert "'replica' was unexpected" in message


def test_the_run_config_loads_and_is_cluster_grade() -> None:
    cfg = run_config()
    assert (cfg.kafka.replication_factor, cfg.kafka.min_insync_replicas) == (3, 2)
    assert cfg.kafka.client_properties["security.protocol"] == "SASL_SSL"
    assert cfg.kafka.secret_properties == {}  # each kind's own secret is in kafka.credentials
    for creds in cfg.kafka.credentials.values():
        assert creds.secret_properties == {"sasl.password": "file:/etc/kafka-user/password"}


def test_kafka_cluster_matches_the_client_config() -> None:
    cfg = run_config()
    (kafka,) = by_kind("Kafka").values()
    (listener,) = kafka["spec"]["kafka"]["listeners"]
    assert cfg.kafka.bootstrap == f"{kafka['metadata']['name']}-kafka-bootstrap:{listener['port']}"
    assert listener["tls"] is True and listener["authentication"]["type"] == "scram-sha-512"
    assert cfg.kafka.client_properties["sasl.mechanism"] == "SCRAM-SHA-512"
    config = kafka["spec"]["kafka"]["config"]
    assert config["min.insync.replicas"] == cfg.kafka.min_insync_replicas
    assert config["transaction.state.log.min.isr"] == cfg.kafka.min_insync_replicas
    pools = by_kind("KafkaNodePool").values()
    assert sum(p["spec"]["replicas"] for p in pools if "broker" in p["spec"]["roles"]) >= (
        cfg.kafka.replication_factor or 1
    )
    users = list(by_kind("KafkaUser").values())
    for user in users:
        assert user["spec"]["authentication"]["type"] == "scram-sha-512"
    for obj in [*by_kind("KafkaTopic").values(), *pools, *users]:
        assert obj["metadata"]["labels"]["strimzi.io/cluster"] == kafka["metadata"]["name"]


def test_kafka_topics_are_the_topology_of_the_run() -> None:
    cfg = run_config()
    names = TopicNames(run=cfg.run, prefix=cfg.kafka.prefix)
    factors = names.replication_factors(cfg.kafka.replication_factor)
    want = {
        name: (parts, factors[name], conf)
        for name, parts, conf in names.all_topics(cfg.kafka.partitions, cfg.kafka.min_insync_replicas)
    }
    got = {
        t["spec"]["topicName"]: (t["spec"]["partitions"], t["spec"]["replicas"], t["spec"]["config"])
        for t in by_kind("KafkaTopic").values()
    }
    assert got == want


def test_keda_scales_each_consumer_on_its_own_group_and_topic() -> None:
    cfg = run_config()
    names = TopicNames(run=cfg.run, prefix=cfg.kafka.prefix)
    specs = load_topology()
    auths = by_kind("TriggerAuthentication")
    statefulsets = by_kind("StatefulSet")
    scaled = {
        o["spec"]["scaleTargetRef"]["name"]: o
        for o in by_kind("ScaledObject").values()
        if o["spec"]["triggers"][0]["type"] == "kafka"
    }
    assert set(scaled) == {f"stream-rl-{role}" for role in ("actor", "verifier", "preprocessor")}
    for target, obj in scaled.items():
        role = target.removeprefix("stream-rl-")
        assert obj["spec"]["scaleTargetRef"]["kind"] == "StatefulSet" and target in statefulsets
        (trigger,) = obj["spec"]["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "kafka" and trigger["authenticationRef"]["name"] in auths
        assert meta["bootstrapServers"] == cfg.kafka.bootstrap
        assert meta["consumerGroup"] == names.group(role)
        (topic,) = [s for s in specs.values() if role in s.consumers]
        assert meta["topic"] == names[topic.name]
        assert int(meta["lagThreshold"]) > 0
        # More replicas than partitions would idle: KEDA caps at the partition count anyway.
        assert 1 <= obj["spec"]["minReplicaCount"] <= obj["spec"]["maxReplicaCount"] <= topic.partitions
    params = {r["parameter"] for a in auths.values() for r in a["spec"]["secretTargetRef"]}
    assert {"sasl", "tls", "username", "password", "ca"} <= params


def _args(container: dict[str, Any]) -> list[str]:
    return [a.replace("$(POD_NAME)", POD_NAME) for a in container["args"]]


def test_every_container_runs_a_real_command_with_arguments_its_parser_takes() -> None:
    for name, spec in pod_specs().items():
        (container,) = spec["containers"]
        args = _args(container)
        parser, _ = command_parser(args[0])
        parsed = parser.parse_args(args[1:])
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        if getattr(parsed, "config", None):
            assert Path(parsed.config).parent.as_posix() in mounts, name
        if getattr(parsed, "metrics_port", None):
            ports = {p["containerPort"] for p in container["ports"]}
            assert parsed.metrics_port in ports, name
        assert container["image"] == "stream-rl:latest", shlex.join(args)


def _mounted_from(spec: dict[str, Any], path: str) -> tuple[str, str]:
    """(volume source, key or claim) of the file or directory `path` in a pod's only container."""
    (container,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for m in container["volumeMounts"]:
        root = m["mountPath"]
        if path == root or path.startswith(root + "/"):
            vol = volumes[m["name"]]
            rest = path[len(root) + 1 :]
            if "secret" in vol:
                items = {i["path"]: i["key"] for i in vol["secret"].get("items", [])}
                return vol["secret"]["secretName"], items.get(rest, rest)
            if "configMap" in vol:
                return vol["configMap"]["name"], rest
            return "pvc", vol["persistentVolumeClaim"]["claimName"]
    raise AssertionError(f"{path} is not mounted")


def _kind(spec: dict[str, Any]) -> str:
    """The kind of process a pod runs as on Kafka: its stage, else the operator (`topics`, `servers`)."""
    command = spec["containers"][0]["args"][0]
    return command if command in run_config().kafka.credentials else "operator"


def _own_secret_is_mounted(spec: dict[str, Any], name: str) -> None:
    """The pod mounts the Secret of its own kind's KafkaUser where its credentials name the
    password, and no other KafkaUser's Secret."""
    kafka = run_config().kafka.for_role(_kind(spec))
    secret = _mounted_from(spec, kafka.secret_properties["sasl.password"].removeprefix("file:"))
    assert secret == (kafka.client_properties["sasl.username"], "password"), name
    users = set(by_kind("KafkaUser"))
    mounted = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v} & users
    assert mounted == {kafka.client_properties["sasl.username"]}, name


def test_every_path_the_config_names_is_mounted() -> None:
    cfg = run_config()
    claims = set(by_kind("PersistentVolumeClaim"))
    for name, spec in pod_specs().items():
        if "--config" not in spec["containers"][0]["args"]:
            continue  # the servers: `serve` takes its settings as flags
        assert _mounted_from(spec, "/etc/stream-rl/run.yaml") == ("stream-rl-run", "run.yaml"), name
        ca = _mounted_from(spec, cfg.kafka.client_properties["ssl.ca.location"])
        assert ca == ("stream-rl-cluster-ca-cert", "ca.crt"), name
        _own_secret_is_mounted(spec, name)
        for volume in spec["volumes"]:
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
    trainer = pod_specs()["stream-rl-trainer"]
    assert _mounted_from(trainer, cfg.model.path) == ("pvc", "stream-rl-models")
    assert _mounted_from(trainer, cfg.trainer.checkpoint_dir or "") == ("pvc", "stream-rl-runs")
    assert _mounted_from(trainer, cfg.runs_dir) == ("pvc", "stream-rl-runs")


def test_servers_and_trainer_agree_with_the_config() -> None:
    cfg = run_config()
    sts = by_kind("StatefulSet")["stream-rl-server"]
    service = by_kind("Service")[sts["spec"]["serviceName"]]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    parsed = command_parser("serve")[0].parse_args(container["args"][1:])
    assert service["spec"]["clusterIP"] == "None"  # per-pod DNS names
    assert parsed.port in {p["port"] for p in service["spec"]["ports"]}
    assert parsed.device == cfg.inference.device == "cuda"
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert _mounted_from(sts["spec"]["template"]["spec"], parsed.model) == ("pvc", "stream-rl-models")
    urls = [
        f"http://{sts['metadata']['name']}-{i}.{service['metadata']['name']}:{parsed.port}"
        for i in range(sts["spec"]["replicas"])
    ]
    assert cfg.inference.server_urls() == urls and cfg.inference.num_servers == 0
    trainer = by_kind("Deployment")["stream-rl-trainer"]
    assert trainer["spec"]["replicas"] == 1 and trainer["spec"]["strategy"]["type"] == "Recreate"
    (tc,) = trainer["spec"]["template"]["spec"]["containers"]
    assert tc["resources"]["limits"]["nvidia.com/gpu"] >= 1
    sync = by_kind("Service")[cfg.trainer.sync_master_addr]
    assert sync["spec"]["clusterIP"] == "None"  # resolves to the pod's own IP, which the store binds
    assert cfg.trainer.sync_master_port in {p["port"] for p in sync["spec"]["ports"]}
    assert cfg.trainer.sync_master_port in {p["containerPort"] for p in tc["ports"]}
    assert sync["spec"]["selector"] == trainer["spec"]["selector"]["matchLabels"]


def test_scalable_stages_take_their_pod_name_as_instance() -> None:
    for role in ("actor", "verifier", "preprocessor"):
        sts = by_kind("StatefulSet")[f"stream-rl-{role}"]
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        assert container["args"][container["args"].index("--instance") + 1] == "$(POD_NAME)"
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["STREAM_RL_METRICS_HOST"]["value"] == "0.0.0.0"


def test_server_pods_join_and_leave_the_run_from_their_hooks() -> None:
    sts = by_kind("StatefulSet")["stream-rl-server"]
    spec = sts["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    cfg = run_config()
    port = command_parser("serve")[0].parse_args(container["args"][1:]).port
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    url = f"http://{sts['metadata']['name']}-0.{sts['spec']['serviceName']}:{port}"
    assert url in cfg.inference.server_urls()  # the hooks name a listed pod as the config does
    for hook, action in (("postStart", "join"), ("preStop", "leave")):
        sh, dash_c, line = container["lifecycle"][hook]["exec"]["command"]
        assert (sh, dash_c) == ("sh", "-c") and line.startswith("exec stream-rl servers ")
        args = shlex.split(line)[2:]
        parsed = command_parser("servers")[0].parse_args(args[1:])
        assert (
            parsed.action == action and parsed.url.replace("$POD_NAME", f"{sts['metadata']['name']}-0") == url
        )
        assert _mounted_from(spec, parsed.config) == ("stream-rl-run", "run.yaml")
    leave = command_parser("servers")[0].parse_args(
        shlex.split(container["lifecycle"]["preStop"]["exec"]["command"][2])[3:]
    )
    assert spec["terminationGracePeriodSeconds"] > leave.timeout_s  # the drain ends before SIGKILL
    ca = _mounted_from(spec, cfg.kafka.client_properties["ssl.ca.location"])
    assert ca == ("stream-rl-cluster-ca-cert", "ca.crt")
    _own_secret_is_mounted(spec, "stream-rl-server")  # the hooks run `servers` as the operator


def test_kafka_users_are_the_acl_plan_of_the_run() -> None:
    """users.yaml is what `stream-rl acls plan --strimzi` prints for the run: one KafkaUser per
    kind of process, named as its principal, with exactly its planned rights; every kind with a
    pod has credentials, and those name its principal."""
    from stream_rl.kafka.acls import plan_acls
    from stream_rl.kafka.strimzi import kafka_users

    cfg = run_config()
    (kafka,) = by_kind("Kafka").values()
    rows = plan_acls(TopicNames(run=cfg.run, prefix=cfg.kafka.prefix), cfg.kafka.principals.model_dump())
    assert list(by_kind("KafkaUser").values()) == kafka_users(rows, kafka["metadata"]["name"])
    for name, spec in pod_specs().items():
        kind = _kind(spec)
        own = cfg.kafka.for_role(kind).client_properties["sasl.username"]
        assert getattr(cfg.kafka.principals, kind) == f"User:{own}", name


def test_keda_scales_the_servers_on_the_occupancy_the_launcher_policy_uses() -> None:
    """The servers' ScaledObject: a Prometheus trigger on the series the built-in server exports,
    with the local policy's thresholds (launcher.autoscale, docs/autoscaling.md), as are the
    verifier's and preprocessor's lagThreshold."""
    import re

    from prometheus_client.parser import text_string_to_metric_families

    from stream_rl.config.autoscale import Thresholds
    from stream_rl.inference.engine import EngineStats
    from stream_rl.inference.metrics import ServerMetrics

    class Engine:
        def stats(self) -> EngineStats:
            return EngineStats(1, 2, 0, 0, 0, 0, 0.0, True, 0.0, max_batch=128, sequence_s=3.0)

    text = ServerMetrics(Engine()).render().decode()  # type: ignore[arg-type]
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    scaled = {o["spec"]["scaleTargetRef"]["name"]: o for o in by_kind("ScaledObject").values()}
    server = scaled["stream-rl-server"]
    assert server["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    assert server["spec"]["scaleTargetRef"]["name"] in by_kind("StatefulSet")
    (trigger,) = server["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert meta["serverAddress"].startswith("http") and set(meta) >= {"query", "threshold"}
    query = meta["query"]
    assert query.count("(") == query.count(")")
    used = set(re.findall(r"stream_rl_\w+", query))
    want = {
        "stream_rl_inference_sequence_seconds_total",
        "stream_rl_inference_max_batch",
        "stream_rl_inference_waiting",
    }
    assert used == want, used
    assert used <= exported, used - exported
    th = Thresholds()
    assert float(meta["threshold"]) == th.occupancy_high
    lag = {
        o["spec"]["scaleTargetRef"]["name"]: int(o["spec"]["triggers"][0]["metadata"]["lagThreshold"])
        for o in scaled.values()
        if o["spec"]["triggers"][0]["type"] == "kafka"
    }
    assert (
        lag["stream-rl-verifier"] == th.verifier_lag and lag["stream-rl-preprocessor"] == th.preprocessor_lag
    )
    # The servers config.yaml lists stay; the pods' /metrics are scraped where the query looks.
    assert server["spec"]["minReplicaCount"] >= len(run_config().inference.servers)
    annotations = by_kind("StatefulSet")["stream-rl-server"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8100"
