"""`stream-rl kafka up --secure`: a local KRaft broker that authenticates and authorizes every client.

    stream-rl kafka up --secure [--run R] [--config run.yaml] [--data-dir D] [--port P]

Listeners (no PLAINTEXT one, so no door without credentials):
- `SASL_SSL` on `--port`: TLS, then SCRAM-SHA-512 users (stored in the cluster's metadata);
- `MTLS` on `--port + 1`: TLS with a client certificate signed by the local CA, the principal taken
  from the certificate's CN (`ssl.principal.mapping.rules`);
- `INTERNAL` (broker to broker) and `CONTROLLER`, on loopback: mutual TLS with the broker's own
  certificate (CN=broker).

The StandardAuthorizer (KRaft) decides every request from ACLs, `allow.everyone.if.no.acl.found`
false; the super users are `User:broker` and `User:operator` only. `up` makes (once) a CA and the
broker's certificate with `openssl` under `<data_dir>/secure/`, formats the storage with the
operator's SCRAM user, starts the broker, then enrolls the run (`enroll`): a SCRAM user and a
client certificate per kind of process (`<run>-<role>`), the ACLs `stream-rl acls plan` derives for
them (`stream_rl/kafka/acls.py`), and the run's config files under `<data_dir>/secure/runs/<run>/`:
`kafka.yaml` (the `kafka:` section: SCRAM), `kafka-mtls.yaml` (the same over the MTLS listener) and,
with `--config`, `run.yaml` (that config with the secure `kafka:` section). Secrets (passwords,
private keys) are files with mode 0600, named by reference (`file:PATH`); the YAML holds none.
`up --secure --run R2` on a running secure broker enrolls another run: its principals get no right
on the first run's resources.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from stream_rl.errors import BrokerError
from stream_rl.kafka.acls import STAGES

SCRAM_MECHANISM = "SCRAM-SHA-512"
SCRAM_ITERATIONS = 8192
OPERATOR = "operator"
BROKER_CN = "broker"
ENROLLED = (*STAGES, "launcher")
"""The kinds of process that get their own user per run (the operator is one user for all)."""
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
PRINCIPAL_RULE = "RULE:^CN=([A-Za-z0-9._-]+)$/$1/,DEFAULT"
"""A certificate whose subject is `CN=name` is `User:name`; any other subject keeps its full DN."""
CERT_DAYS = 30


def write_secret(path: Path, text: str) -> Path:
    """`text` into `path`, readable by its owner only (created 0600, never wider for a moment)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return path


def _openssl() -> str:
    path = shutil.which("openssl")
    if path is None:
        raise BrokerError(
            "openssl not found on PATH: `kafka up --secure` makes its CA and certificates with it"
        )
    return path


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BrokerError(f"{' '.join(cmd[:3])} failed: {(proc.stderr or proc.stdout).strip()[:300]}")


@dataclass(frozen=True)
class Pki:
    """A private CA in `dir` and the certificates it issues (EC P-256, PEM, keys unencrypted 0600)."""

    dir: Path
    subject: str = "/CN=stream-rl local CA"

    @property
    def ca_pem(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def _ca_key(self) -> Path:
        return self.dir / "ca.key"

    def make_ca(self) -> Path:
        """The CA (once); returns its certificate (what every client and the broker trust)."""
        if self.ca_pem.exists() and self._ca_key.exists():
            return self.ca_pem
        self.dir.mkdir(parents=True, exist_ok=True)
        write_secret(self._ca_key, "")
        _run(
            [_openssl(), "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-noenc", "-keyout", str(self._ca_key), "-out", str(self.ca_pem), "-days", str(CERT_DAYS),
             "-subj", self.subject, "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign"]
        )  # fmt: skip
        return self.ca_pem

    def issue(self, name: str, cn: str, sans: str | None = None, days: int = CERT_DAYS) -> tuple[Path, Path]:
        """A certificate for `CN=cn` signed by the CA (with `sans`, e.g. `IP:127.0.0.1,DNS:localhost`,
        for a server), valid `days` (0: expired a second after): (certificate, key) in `dir/name.crt` and
        `dir/name.key`; kept when present."""
        crt, key = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        if crt.exists() and key.exists():
            return crt, key
        csr, ext = self.dir / f"{name}.csr", self.dir / f"{name}.ext"
        write_secret(key, "")
        _run(
            [_openssl(), "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-noenc", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={cn}"]
        )  # fmt: skip
        ext.write_text("basicConstraints=CA:FALSE\n" + (f"subjectAltName={sans}\n" if sans else ""))
        _run(
            [_openssl(), "x509", "-req", "-in", str(csr), "-CA", str(self.ca_pem), "-CAkey", str(self._ca_key),
             "-CAcreateserial", "-out", str(crt), "-days", str(days), "-extfile", str(ext)]
        )  # fmt: skip
        csr.unlink()
        ext.unlink()
        return crt, key


@dataclass(frozen=True)
class SecurePorts:
    """What `<data_dir>/secure/secure.json` records, so `status`, `down` and a later `up` find them."""

    host: str
    port: int
    """SASL_SSL (SCRAM) clients."""
    mtls_port: int
    """SSL clients with a certificate."""
    internal_port: int
    """Broker to broker (mutual TLS, loopback)."""


@dataclass(frozen=True)
class SecureListeners:
    """The listeners of a secured `LocalBroker` (`LocalBroker(listener=...)`): see the module docstring."""

    dir: Path
    """`<data_dir>/secure`: the CA, the broker's certificate, the operator's password, the runs."""
    ports: SecurePorts
    """This node's."""
    nodes: tuple[SecurePorts, ...] = ()
    """Every node's, for a cluster (`kafka up --secure --brokers N`); () for one broker."""

    @property
    def all_nodes(self) -> tuple[SecurePorts, ...]:
        return self.nodes or (self.ports,)

    def node(self, i: int) -> SecureListeners:
        """Node `i`'s listeners (same CA, certificates and users)."""
        return SecureListeners(self.dir, self.all_nodes[i], self.all_nodes)

    @property
    def pki(self) -> Pki:
        return Pki(self.dir / "pki")

    @property
    def operator_password_file(self) -> Path:
        return self.dir / "operator.password"

    def prepare(self) -> None:
        """The CA, the broker's and the operator's certificates and the operator's password (once)."""
        pki = self.pki
        pki.make_ca()
        host = self.ports.host
        sans = "IP:127.0.0.1,DNS:localhost" + (
            "" if host in ("127.0.0.1", "localhost") else f",{'IP' if host[0].isdigit() else 'DNS'}:{host}"
        )
        crt, key = pki.issue("broker", BROKER_CN, sans)
        # Kafka's PEM keystore: the key and the chain in one file.
        write_secret(self.dir / "broker.pem", key.read_text() + crt.read_text() + pki.ca_pem.read_text())
        pki.issue(OPERATOR, OPERATOR)
        if not self.operator_password_file.exists():
            write_secret(self.operator_password_file, secrets.token_urlsafe(24))
        (self.dir / "secure.json").write_text(json.dumps({"nodes": [asdict(n) for n in self.all_nodes]}))

    # -- the broker's side (stream_rl.kafka.listener.Listener) ----------------------------------
    def extra_ports(self) -> list[tuple[int, str]]:
        return [(self.ports.mtls_port, "MTLS"), (self.ports.internal_port, "INTERNAL")]

    def overrides(self, host: str, port: int, controller_port: int) -> dict[str, str]:
        p = self.ports
        listeners = (
            f"SASL_SSL://{host}:{port},MTLS://{host}:{p.mtls_port},"
            f"INTERNAL://127.0.0.1:{p.internal_port},CONTROLLER://127.0.0.1:{controller_port}"
        )
        return {
            "listeners": listeners,
            "advertised.listeners": listeners,
            "listener.security.protocol.map": "CONTROLLER:SSL,INTERNAL:SSL,SASL_SSL:SASL_SSL,MTLS:SSL",
            "inter.broker.listener.name": "INTERNAL",
            "sasl.enabled.mechanisms": SCRAM_MECHANISM,
            "listener.name.sasl_ssl.sasl.enabled.mechanisms": SCRAM_MECHANISM,
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            ),
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(self.dir / "broker.pem"),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.pki.ca_pem),
            "ssl.client.auth": "required",
            "listener.name.sasl_ssl.ssl.client.auth": "none",
            "ssl.principal.mapping.rules": PRINCIPAL_RULE,
            "authorizer.class.name": AUTHORIZER,
            "allow.everyone.if.no.acl.found": "false",
            "super.users": f"User:{BROKER_CN};User:{OPERATOR}",
        }

    def format_args(self) -> list[str]:
        password = self.operator_password_file.read_text()
        return ["--add-scram", f"{SCRAM_MECHANISM}=[name={OPERATOR},password={password}]"]

    def probe_properties(self) -> dict[str, str]:
        return {
            **self.scram_properties(),
            "sasl.username": OPERATOR,
            "sasl.password": self.operator_password_file.read_text(),
        }

    # -- the clients' side ------------------------------------------------------------------
    def scram_properties(self) -> dict[str, str]:
        """`kafka.client_properties` of every process on the SASL_SSL listener."""
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": SCRAM_MECHANISM,
            "ssl.ca.location": str(self.pki.ca_pem),
        }

    def mtls_properties(self) -> dict[str, str]:
        """`kafka.client_properties` of every process on the MTLS listener (plus its certificate)."""
        return {"security.protocol": "SSL", "ssl.ca.location": str(self.pki.ca_pem)}

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{n.host}:{n.port}" for n in self.all_nodes)

    @property
    def mtls_bootstrap(self) -> str:
        return ",".join(f"{n.host}:{n.mtls_port}" for n in self.all_nodes)


def secure_dir(data_dir: str | Path) -> Path:
    return Path(data_dir).resolve() / "secure"


def secure_listeners(data_dir: str | Path) -> SecureListeners | None:
    """The secured broker's listeners recorded in `data_dir` (None: it is not a secured broker's)."""
    d = secure_dir(data_dir)
    try:
        nodes = tuple(SecurePorts(**n) for n in json.loads((d / "secure.json").read_text())["nodes"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return SecureListeners(d, nodes[0], nodes if len(nodes) > 1 else ())


@dataclass(frozen=True)
class Enrollment:
    """What `enroll` made for one run: where its config files are."""

    run: str
    dir: Path
    kafka_yaml: Path
    mtls_yaml: Path
    run_yaml: Path | None
    acls_created: int


def user_name(run: str, role: str) -> str:
    return f"{run}-{role}"


def _credentials_section(listeners: SecureListeners, run_dir: Path, run: str) -> dict[str, Any]:
    creds: dict[str, Any] = {
        OPERATOR: {
            "client_properties": {"sasl.username": OPERATOR},
            "secret_properties": {"sasl.password": f"file:{listeners.operator_password_file}"},
        }
    }
    for role in ENROLLED:
        creds[role] = {
            "client_properties": {"sasl.username": user_name(run, role)},
            "secret_properties": {"sasl.password": f"file:{run_dir / f'{role}.password'}"},
        }
    return creds


def _mtls_credentials(listeners: SecureListeners, run: str) -> dict[str, Any]:
    pki = listeners.pki
    creds: dict[str, Any] = {}
    for role, cn in ((OPERATOR, OPERATOR), *((r, user_name(run, r)) for r in ENROLLED)):
        crt, key = pki.issue(cn, cn)
        creds[role] = {
            "client_properties": {"ssl.certificate.location": str(crt), "ssl.key.location": str(key)}
        }
    return creds


def kafka_section(listeners: SecureListeners, run: str, prefix: str, *, mtls: bool = False) -> dict[str, Any]:
    """The run config's `kafka:` section for run `run` on this broker (SCRAM, or `mtls`)."""
    run_dir = listeners.dir / "runs" / run
    principals = {role: f"User:{user_name(run, role)}" for role in ENROLLED}
    principals[OPERATOR] = f"User:{OPERATOR}"
    replicas = len(listeners.all_nodes)
    copies = (
        {"replication_factor": min(3, replicas), "min_insync_replicas": min(2, replicas)}
        if replicas > 1
        else {}
    )
    return {
        "bootstrap": listeners.mtls_bootstrap if mtls else listeners.bootstrap,
        "prefix": prefix,
        **copies,
        "client_properties": listeners.mtls_properties() if mtls else listeners.scram_properties(),
        "principals": principals,
        "credentials": _mtls_credentials(listeners, run)
        if mtls
        else _credentials_section(listeners, run_dir, run),
    }


def upsert_scram_users(admin: Any, passwords: dict[str, str]) -> None:
    """Create (or set the password of) each SCRAM-SHA-512 user, user -> password, through the Admin
    API (`admin`: confluent-kafka's AdminClient, connected as a super user)."""
    from confluent_kafka.admin import (
        ScramCredentialInfo,
        ScramMechanism,
        UserScramCredentialAlteration,
        UserScramCredentialUpsertion,
    )

    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
    upserts: list[UserScramCredentialAlteration] = [
        UserScramCredentialUpsertion(user, info, password.encode()) for user, password in passwords.items()
    ]
    for user, fut in admin.alter_user_scram_credentials(upserts).items():
        try:
            fut.result(timeout=30)
        except Exception as exc:  # noqa: BLE001 - librdkafka's KafkaException, one line
            raise BrokerError(f"creating the SCRAM user {user} failed: {exc}") from exc


def enroll(listeners: SecureListeners, run: str, prefix: str, base_config: Path | None = None) -> Enrollment:
    """Users, certificates, ACLs and config files of run `run` (idempotent: existing passwords and
    certificates are kept, missing ACLs created). Connects as the operator."""
    from stream_rl.config import KafkaConfig
    from stream_rl.kafka.acl_admin import KafkaAcls, apply_acls
    from stream_rl.kafka.acls import plan_acls
    from stream_rl.kafka.confluent import KafkaTransport
    from stream_rl.kafka.topics import TopicNames

    run_dir = listeners.dir / "runs" / run
    run_dir.mkdir(parents=True, exist_ok=True)
    section = kafka_section(listeners, run, prefix)
    # As the operator (a super user), with the section written into the run's config.
    admin = KafkaTransport.for_run(KafkaConfig.model_validate(section)).admin
    passwords: dict[str, str] = {}
    for role in ENROLLED:
        pw_file = run_dir / f"{role}.password"
        if not pw_file.exists():
            write_secret(pw_file, secrets.token_urlsafe(24))
        passwords[user_name(run, role)] = pw_file.read_text()
    upsert_scram_users(admin, passwords)
    names = TopicNames(run=run, prefix=prefix)
    planned = plan_acls(names, section["principals"])
    report = apply_acls(KafkaAcls(admin, listeners.bootstrap), planned, names)
    kafka_yaml = run_dir / "kafka.yaml"
    header = "# Written by `stream-rl kafka up --secure`: secrets are files (mode 0600) named by reference.\n"
    kafka_yaml.write_text(header + yaml.safe_dump({"kafka": section}, sort_keys=False))
    mtls_yaml = run_dir / "kafka-mtls.yaml"
    mtls = kafka_section(listeners, run, prefix, mtls=True)
    mtls_yaml.write_text(header + yaml.safe_dump({"kafka": mtls}, sort_keys=False))
    run_yaml = None
    if base_config is not None:
        from stream_rl.config.loading import deep_merge

        data = yaml.safe_load(base_config.read_text()) or {}
        data["run"] = run
        data["kafka"] = deep_merge(
            {
                k: v
                for k, v in (data.get("kafka") or {}).items()
                if k not in ("client_properties", "secret_properties")
            },
            section,
        )
        run_yaml = run_dir / "run.yaml"
        run_yaml.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return Enrollment(run, run_dir, kafka_yaml, mtls_yaml, run_yaml, len(report.created))
