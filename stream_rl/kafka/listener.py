"""A SASL/PLAIN-over-TLS client listener for the local broker (`LocalBroker(listener=...)`).

The broker keeps its PLAINTEXT listener on 127.0.0.1 for itself (inter-broker traffic and the
readiness probe of `LocalBroker.up`); clients are given the SASL_SSL port, where TLS uses the
PKCS12 `keystore` (made with the JDK's `keytool`) and SASL/PLAIN checks `users`. What a client needs
to connect is `client_properties` (+ its password as `sasl.password`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


class Listener(Protocol):
    """The client listeners a `LocalBroker` is started with besides (or instead of) its PLAINTEXT one."""

    def extra_ports(self) -> list[tuple[int, str]]:
        """(port, listener name) of each port it listens on besides the broker's own `port`."""
        ...

    def overrides(self, host: str, port: int, controller_port: int) -> dict[str, str]:
        """The broker's properties replacing the template's (an empty value drops a key)."""
        ...

    def format_args(self) -> list[str]:
        """Extra arguments of `kafka-storage format` (e.g. SCRAM users)."""
        ...

    def probe_properties(self) -> dict[str, str]:
        """The client properties of the readiness probe on the broker's `port`."""
        ...


def _jaas_quote(value: str) -> str:
    if '"' in value or "\\" in value or "\n" in value:
        raise ValueError("SASL/PLAIN users and passwords here may not hold quotes, backslashes or newlines")
    return f'"{value}"'


@dataclass(frozen=True)
class SaslSslListener:
    port: int
    """Client port of the SASL_SSL listener."""
    keystore: Path
    """PKCS12 keystore holding the broker's key and certificate (its SAN must name the host)."""
    keystore_password: str = field(repr=False)
    ca_pem: Path
    """The certificate clients trust (`ssl.ca.location`): the broker's own when self-signed."""
    users: dict[str, str] = field(repr=False, default_factory=dict)
    """SASL/PLAIN users: name -> password."""
    acl_super_users: tuple[str, ...] | None = None
    """None: no authorizer (every user may do anything). Names: the broker authorizes every request
    with ACLs (KRaft's `StandardAuthorizer`, nothing allowed without one); these users are super
    users, and so is the broker itself on its PLAINTEXT and CONTROLLER listeners (`User:ANONYMOUS`,
    hence any client on the loopback PLAINTEXT port too)."""

    def extra_ports(self) -> list[tuple[int, str]]:
        return [(self.port, "SASL_SSL")]

    def overrides(self, host: str, port: int, controller_port: int) -> dict[str, str]:
        raise NotImplementedError(
            "LocalBroker adds this listener to its PLAINTEXT one (broker._with_listener)"
        )

    def format_args(self) -> list[str]:
        return []

    def probe_properties(self) -> dict[str, str]:
        return {}  # the probe goes to the PLAINTEXT port

    def server_properties(self, host: str) -> dict[str, str]:
        """The broker's properties for this listener, on top of the PLAINTEXT/CONTROLLER ones."""
        users = " ".join(f"user_{name}={_jaas_quote(pw)}" for name, pw in self.users.items())
        return {
            "listener.name.sasl_ssl.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.sasl_ssl.plain.sasl.jaas.config": (
                f"org.apache.kafka.common.security.plain.PlainLoginModule required {users};"
            ),
            "sasl.enabled.mechanisms": "PLAIN",
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(self.keystore),
            "ssl.keystore.password": self.keystore_password,
            "ssl.key.password": self.keystore_password,
            "ssl.client.auth": "none",
            **self._authorizer(),
        }

    def _authorizer(self) -> dict[str, str]:
        if self.acl_super_users is None:
            return {}
        supers = ["User:ANONYMOUS", *(f"User:{name}" for name in self.acl_super_users)]
        return {
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": ";".join(supers),
        }

    def client_properties(self, username: str) -> dict[str, str]:
        """What `kafka.client_properties` needs for this listener (the password goes in
        `kafka.secret_properties.sasl.password`)."""
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "PLAIN",
            "sasl.username": username,
            "ssl.ca.location": str(self.ca_pem),
        }
