"""`kafka:`: the cluster, its clients' properties and secrets, topic layout."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator

from stream_rl.config.base import DEFAULT_PREFIX, Model
from stream_rl.errors import ConfigError

RESERVED_KAFKA_PROPERTIES = {
    "bootstrap.servers": "set kafka.bootstrap",
    "compression.type": "set kafka.compression",
    "client.id": "stream-rl names every client after its stage and instance",
    "group.id": "groups are named <prefix>.<run>.<role>",
    "group.instance.id": "set by --instance",
    "transactional.id": "set per stage instance",
    "enable.idempotence": "stream-rl's producers are always idempotent",
    "acks": "stream-rl's producers always use acks=all",
    "enable.auto.commit": "stages commit after their output is durable",
    "enable.auto.offset.store": "stages commit after their output is durable",
    "isolation.level": "consumers read committed records only",
}
"""librdkafka properties the stages' guarantees rest on, with the reason each is refused."""

SECRET_MARKERS = ("password", "secret", "ssl.key.pem", "sasl.oauthbearer.config", "ssl_key")


def _is_secret_key(key: str) -> bool:
    return any(marker in key for marker in SECRET_MARKERS)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """`{security: {protocol: X}}` -> `{"security.protocol": X}`: `--set kafka.client_properties.
    security.protocol=X` (dotted override paths) and nested YAML both give librdkafka's flat keys."""
    if not isinstance(value, dict):
        return {prefix: value} if prefix else {}
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(item, dict):
            out.update(_flatten(item, name))
        else:
            out[name] = item
    return out


def resolve_secret(ref: str, key: str) -> SecretStr:
    """The value a secret reference names: `${NAME}` (an environment variable) or `file:PATH` (the
    file's content, trailing newline stripped). One-line ConfigError naming `key` otherwise."""
    if ref.startswith("${") and ref.endswith("}"):
        name = ref[2:-1]
        value = os.environ.get(name)
        if not value:
            raise ConfigError(f"{key}: environment variable {name} is not set (the config names it: {ref})")
        return SecretStr(value)
    path = Path(ref.removeprefix("file:"))
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read secret file {path}: {exc.strerror}") from exc
    return SecretStr(text.rstrip("\r\n"))


class KafkaPrincipals(Model):
    """The Kafka principal each kind of process authenticates as (`stream-rl acls plan|apply`
    derive their ACLs from the topology). None: no ACLs planned for that kind."""

    loader: str | None = None
    """Principal of the loader, e.g. `User:loader`."""
    actor: str | None = None
    """Principal of every actor replica."""
    verifier: str | None = None
    """Principal of every verifier replica."""
    preprocessor: str | None = None
    """Principal of every preprocessor replica."""
    trainer: str | None = None
    """Principal of the trainer."""
    evaluator: str | None = None
    """Principal of the evaluator."""
    launcher: str | None = None
    """Principal of `stream-rl run` itself (creates the topics, publishes the schemas, reads lag)."""
    operator: str | None = None
    """Principal of the person or job running `topics apply`, `lag`, `status`, `servers`, `export`,
    `track` against the run."""

    @field_validator("*")
    @classmethod
    def _principal(cls, value: str | None) -> str | None:
        if value is None:
            return value
        kind, _, name = value.partition(":")
        if not kind or not name or not kind.isalpha():
            raise ValueError(f"{value!r}: a principal is TYPE:NAME, e.g. User:actor")
        if "*" in value:
            raise ValueError(f"{value!r}: no wildcard principals (each kind gets exactly its own rights)")
        return value


def _flat_properties(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    flat = _flatten(value)
    # librdkafka takes strings; YAML gives true/30000: its spelling of them.
    return {
        k: (str(v).lower() if isinstance(v, bool) else str(v) if isinstance(v, int | float) else v)
        for k, v in flat.items()
    }


def check_properties(where: str, client: dict[str, str], secret: dict[str, str]) -> None:
    """The rules of `client_properties` / `secret_properties` (ValueError naming `where`)."""
    for field, props in (("client_properties", client), ("secret_properties", secret)):
        for key in props:
            if key in RESERVED_KAFKA_PROPERTIES:
                raise ValueError(f"{where}.{field}: {key} is not settable ({RESERVED_KAFKA_PROPERTIES[key]})")
    for key in client:
        if _is_secret_key(key):
            raise ValueError(
                f"{where}.client_properties: {key} holds a secret: put it in {where}.secret_properties "
                "as ${ENV_VAR} or file:PATH"
            )
        if key in secret:
            raise ValueError(f"{where}: {key} is in both client_properties and secret_properties")
    for key, ref in secret.items():
        if not ((ref.startswith("${") and ref.endswith("}") and len(ref) > 3) or ref.startswith("file:")):
            raise ValueError(
                f"{where}.secret_properties: {key}: give a reference, ${{ENV_VAR}} or file:PATH, "
                "never the secret itself (configs are copied into run directories)"
            )


class KafkaCredentials(Model):
    """One kind of process's own client identity: properties laid over `kafka.client_properties` /
    `kafka.secret_properties` for that kind only (its `sasl.username` and `sasl.password`, or its
    `ssl.certificate.location` and `ssl.key.location`). The launcher writes into each stage's config
    only that stage's entry."""

    client_properties: dict[str, str] = Field(default_factory=dict)
    """Non-secret properties of this kind's clients, e.g. `sasl.username: demo-actor`."""
    secret_properties: dict[str, str] = Field(default_factory=dict)
    """Its secrets by reference, e.g. `sasl.password: file:/path/actor.password` (0600)."""

    @field_validator("client_properties", "secret_properties", mode="before")
    @classmethod
    def _flat(cls, value: Any) -> Any:
        return _flat_properties(value)


CREDENTIAL_ROLES = tuple(KafkaPrincipals.model_fields)
"""The kinds of process `kafka.credentials` may name (those of `kafka.principals`)."""


class KafkaConfig(Model):
    bootstrap: str | None = None
    """Bootstrap servers (`host:port,...`). None: the launcher starts (or reuses) the local broker;
    stages fall back to $STREAM_RL_KAFKA_BOOTSTRAP."""
    prefix: str = DEFAULT_PREFIX
    """Topic namespace: topics are named `<prefix>.<run>.<topic>`."""
    data_dir: str = ".kafka"
    """Data directory of the local broker (logs, pid, port), relative to the working directory."""
    port: int = Field(9092, ge=1, le=65535)
    """Port of the local broker (the controller listens on port + 1)."""
    partitions: int | None = Field(None, ge=1)
    """Override the partition count of every data topic (topology default otherwise)."""
    compression: Literal["none", "lz4", "zstd", "gzip", "snappy"] = "zstd"
    """Compression of every record the stages produce (the broker decompresses each batch to
    validate it: its CPU cost per batch; see README Performance)."""
    outage_timeout_s: float = Field(120.0, gt=0)
    """How long every client waits out a broker that stopped answering (a restart) before failing
    with an error; a broker that never answered fails within 10 s."""
    replication_factor: int | None = Field(None, ge=1)
    """Copies of every partition of the run's topics (None: the topology's, 1). On a cluster use 3
    with `min_insync_replicas: 2`: one broker can then fail without losing an acknowledged record."""
    min_insync_replicas: int | None = Field(None, ge=1)
    """Replicas that must hold a record before the (acks=all) producer is told it is written
    (None: the topology's, 1). Must not exceed the replication factor, or every write fails."""

    client_properties: dict[str, str] = Field(default_factory=dict)
    """librdkafka properties given to every Kafka client of every process (stages, trainer,
    launcher, `status`, `lag`, `replay`, ...), e.g. `security.protocol: SASL_SSL`, `sasl.mechanism`,
    `sasl.username`, `ssl.ca.location`. Secrets are refused here (use `secret_properties`), as are
    the properties stream-rl's guarantees rest on (acks, idempotence, ...)."""
    secret_properties: dict[str, str] = Field(default_factory=dict)
    """librdkafka properties whose values are secrets (`sasl.password`, `ssl.key.password`, ...),
    each given as a reference: `${NAME}` (an environment variable) or `file:PATH` (the file's
    content). Run directories and logs hold the reference only; each process reads the value
    (as a `SecretStr`) when it opens its Kafka clients."""
    principals: KafkaPrincipals = Field(default_factory=KafkaPrincipals)
    """Who each kind of process is on a cluster with ACLs (docs/deploy.md "Running on a Kafka cluster")."""
    credentials: dict[str, KafkaCredentials] = Field(default_factory=dict)
    """Each kind of process's own credentials (keys as in `principals`): laid over
    `client_properties` / `secret_properties` for that kind only; a stage's config written by the
    launcher holds its own entry only (docs/security.md). Commands that are no stage (`status`,
    `lag`, `topics`, `acls`, ...) use `operator`'s, `stream-rl run` itself `launcher`'s."""
    _acting_as: str | None = PrivateAttr(None)

    @field_validator("client_properties", "secret_properties", mode="before")
    @classmethod
    def _flat(cls, value: Any) -> Any:
        return _flat_properties(value)

    @model_validator(mode="after")
    def _check_properties(self) -> KafkaConfig:
        check_properties("kafka", self.client_properties, self.secret_properties)
        for role, creds in self.credentials.items():
            where = f"kafka.credentials.{role}"
            if role not in CREDENTIAL_ROLES:
                raise ValueError(f"{where}: no such kind of process (one of {', '.join(CREDENTIAL_ROLES)})")
            check_properties(where, creds.client_properties, creds.secret_properties)
            user, principal = creds.client_properties.get("sasl.username"), getattr(self.principals, role)
            if user is not None and principal is not None and principal != f"User:{user}":
                raise ValueError(
                    f"{where}: sasl.username {user} is not kafka.principals.{role} ({principal})"
                )
        return self

    def for_role(self, role: str) -> KafkaConfig:
        """This config as the processes of kind `role` see it: its own `credentials` entry laid over
        the shared properties, every other entry gone. ConfigError when credentials are configured
        but none for `role`."""
        if not self.credentials:
            return self
        creds = self.credentials.get(role)
        if creds is None:
            raise ConfigError(
                f"kafka.credentials has no entry for {role} (with credentials configured, every kind "
                "of process that connects needs its own)"
            )
        own = {**creds.client_properties, **creds.secret_properties}
        client = {k: v for k, v in self.client_properties.items() if k not in own}
        secret = {k: v for k, v in self.secret_properties.items() if k not in own}
        return self.model_copy(
            update={
                "client_properties": {**client, **creds.client_properties},
                "secret_properties": {**secret, **creds.secret_properties},
                "credentials": {},
            }
        )

    def acting_as(self, role: str) -> KafkaConfig:
        """A copy whose own clients use `role`'s credentials, keeping everyone's (the launcher:
        it writes each stage's own into that stage's config)."""
        copy = self.model_copy()
        copy._acting_as = role
        return copy

    def librdkafka_properties(self) -> dict[str, str | SecretStr]:
        """`client_properties` plus the secrets, read now from the environment or their files
        (ConfigError naming the key when one is missing); with `credentials`, those of the kind of
        process this one acts as (`acting_as`; default the operator)."""
        own = self.for_role(self._acting_as or "operator")
        props: dict[str, str | SecretStr] = dict(own.client_properties)
        for key, ref in own.secret_properties.items():
            props[key] = resolve_secret(ref, f"kafka.secret_properties.{key}")
        return props

    @model_validator(mode="after")
    def _check_replication(self) -> KafkaConfig:
        rf, isr = self.replication_factor, self.min_insync_replicas
        if rf is not None and isr is not None and isr > rf:
            raise ValueError(
                f"kafka.min_insync_replicas ({isr}) must not exceed kafka.replication_factor ({rf})"
            )
        return self
