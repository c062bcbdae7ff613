"""`stream-rl kafka compose-secrets`: the material of the secured Compose variant, written on the host
before `docker compose -f docker-compose.yml -f deploy/compose/secure.yml up`.

    stream-rl kafka compose-secrets [--config configs/demo-docker.yaml] [--out deploy/compose/.secrets]
                                    [--port 9092]

Into `--out` (kept when present, so a second call changes nothing):
- `pki/`: a private CA (`Pki`, as `kafka up --secure` makes) and the broker's certificate
  (CN=broker, SAN `kafka`, `localhost`, 127.0.0.1); `broker.pem`: its key and chain, Kafka's PEM
  keystore; `ca.pem`: the CA certificate every client trusts;
- `operator.password` and `<role>.password` for each stage kind Compose runs (mode 0600): the
  SCRAM users are `operator` (a super user) and `<run>-<role>` (`user_name`);
- `<role>.yaml`: the run config a stage container gets, whose `kafka:` section names that kind's
  principal and credentials only (its password by reference, `file:/run/secrets/<role>.password`);
- `operator.yaml`: the config of the operator's containers (`init`: users, ACLs, topics;
  `lag-exporter`), every principal named, the operator's credentials only;
- `host.yaml`: the operator's config for tools on the host (`localhost:--port`, host paths).

secure.yml grants each service, as a Compose secret under /run/secrets, only the files named here
for it (`GRANTS`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from stream_rl.kafka.secure import BROKER_CN, OPERATOR, SCRAM_MECHANISM, Pki, user_name, write_secret

STAGE_ROLES = ("loader", "actor", "verifier", "preprocessor", "trainer")
"""The kinds of process docker-compose.yml runs (no evaluator, no launcher: Compose is the launcher)."""
IN_CONTAINER = "/run/secrets"
BOOTSTRAP = "kafka:19092"
"""The broker's SASL_SSL listener on the Compose network (secure.yml)."""
GRANTS: dict[str, tuple[str, ...]] = {
    "kafka": ("broker.pem", "ca.pem", "operator.password"),
    "init": ("ca.pem", "operator.password", *(f"{r}.password" for r in STAGE_ROLES)),
    "lag-exporter": ("ca.pem", "operator.password"),
    **{role: ("ca.pem", f"{role}.password") for role in STAGE_ROLES},
}
"""Each Compose service's secrets (the files under /run/secrets in its container). `init` creates
the stages' SCRAM users, so it holds their passwords; it exits before any stage starts."""


@dataclass(frozen=True)
class ComposeSecrets:
    out: Path
    created: list[str]
    """Files made by this call (existing ones are kept)."""


def _kafka_section(
    run: str, prefix: str, role: str, roles: tuple[str, ...], bootstrap: str, dir: str
) -> dict[str, Any]:
    username = OPERATOR if role == OPERATOR else user_name(run, role)
    principals = {r: f"User:{user_name(run, r)}" for r in roles if r != OPERATOR}
    if OPERATOR in roles:
        principals[OPERATOR] = f"User:{OPERATOR}"
    return {
        "bootstrap": bootstrap,
        "prefix": prefix,
        "client_properties": {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": SCRAM_MECHANISM,
            "ssl.ca.location": f"{dir}/ca.pem",
        },
        "principals": principals,
        "credentials": {
            role: {
                "client_properties": {"sasl.username": username},
                "secret_properties": {"sasl.password": f"file:{dir}/{role}.password"},
            }
        },
    }


def write_compose_secrets(config: Path, out: Path, host_port: int = 9092) -> ComposeSecrets:
    """The CA, the broker's keystore, the passwords and the configs of module docstring (idempotent)."""
    from stream_rl.config import load_config

    cfg = load_config(config)
    run, prefix = cfg.run, cfg.kafka.prefix
    out = out.resolve()
    before = {p for p in out.rglob("*")} if out.exists() else set()
    pki = Pki(out / "pki")
    pki.make_ca()
    crt, key = pki.issue("broker", BROKER_CN, "DNS:kafka,DNS:localhost,IP:127.0.0.1")
    if not (out / "broker.pem").exists():
        write_secret(out / "broker.pem", key.read_text() + crt.read_text() + pki.ca_pem.read_text())
    (out / "ca.pem").write_text(pki.ca_pem.read_text())
    for role in (OPERATOR, *STAGE_ROLES):
        if not (out / f"{role}.password").exists():
            write_secret(out / f"{role}.password", secrets.token_urlsafe(24))
    base = yaml.safe_load(config.read_text()) or {}
    header = (
        "# Written by `stream-rl kafka compose-secrets` from {src}: {what}.\n"
        "# Secrets are files under /run/secrets, named by reference; this file holds none.\n"
    )

    def write_config(name: str, kafka: dict[str, Any], what: str) -> None:
        data = {**base, "kafka": {**(base.get("kafka") or {}), **kafka}}
        (out / name).write_text(header.format(src=config, what=what) + yaml.safe_dump(data, sort_keys=False))

    for role in STAGE_ROLES:
        section = _kafka_section(run, prefix, role, (role,), BOOTSTRAP, IN_CONTAINER)
        write_config(f"{role}.yaml", section, f"the {role} containers' config (its own credentials only)")
    everyone = (*STAGE_ROLES, OPERATOR)
    section = _kafka_section(run, prefix, OPERATOR, everyone, BOOTSTRAP, IN_CONTAINER)
    write_config("operator.yaml", section, "the operator's containers' config (init, lag-exporter)")
    section = _kafka_section(run, prefix, OPERATOR, everyone, f"localhost:{host_port}", str(out))
    write_config("host.yaml", section, "the operator's config for tools on the host")
    created = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p not in before and p.is_file())
    return ComposeSecrets(out, created)
