"""`check_reachable`: whether a broker answers at a bootstrap address, and if not, why (refused
credentials, TLS, a security.protocol mismatch, nobody there), in one line."""

from __future__ import annotations

import logging
import time
from typing import Any

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient

from stream_rl.errors import KafkaError
from stream_rl.kafka.librdkafka import Properties, build_client, client_conf, principal
from stream_rl.kafka.outage import reachable_wait_s


class _ProbeLog(logging.Logger):
    """librdkafka's log lines of `check_reachable`, kept to explain a failure, never printed."""

    def __init__(self) -> None:
        super().__init__("stream_rl.kafka.probe")
        self.propagate = False
        self.closed_before_answering = False
        self.closed_after_tls = False

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        # A listener that wants TLS (or SASL) drops a plaintext client during its first request.
        text = str(msg) % args if args else str(msg)
        if "Disconnected" in text and "APIVERSION_QUERY" in text:
            self.closed_before_answering = True
        # A SASL_SSL listener drops a client that speaks TLS but no SASL once it sends a request.
        if "SSL connection closed by peer" in text and "in state UP" in text:
            self.closed_after_tls = True


_AUTH_ERRORS = (ck.KafkaError._AUTHENTICATION, ck.KafkaError.SASL_AUTHENTICATION_FAILED)


def check_reachable(
    bootstrap: str, timeout: float | None = None, properties: Properties | None = None
) -> None:
    """Raise a one-line KafkaError unless a broker at `bootstrap` answers within `timeout`
    (default 10 s, or $STREAM_RL_KAFKA_REACHABLE_WAIT_S). A broker that refuses our credentials
    fails at once, naming the problem; a TLS or protocol mismatch names librdkafka's last error."""
    timeout = reachable_wait_s() if timeout is None else timeout
    errors: list[ck.KafkaError] = []
    probe = _ProbeLog()
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "logger": probe,  # kept, not printed: connection-refused noise is expected while a broker starts
        "socket.connection.setup.timeout.ms": 3000,
        "error_cb": errors.append,
    }
    admin = build_client(AdminClient, {**conf, **client_conf(properties)})
    deadline = time.monotonic() + timeout
    while True:
        try:
            if admin.list_topics(timeout=min(1.0, max(deadline - time.monotonic(), 0.1))).brokers:
                return
        except ck.KafkaException:
            pass  # "failed to get metadata": the error_cb events below say why
        admin.poll(0)  # serves error_cb: the connection's own errors (refused, TLS, SASL)
        auth = [e for e in errors if e.code() in _AUTH_ERRORS]
        if auth:
            raise KafkaError(
                f"Kafka at {bootstrap} refused our credentials: {auth[-1].str()} (as "
                f"{principal(properties)}; check "
                "kafka.client_properties sasl.mechanism/sasl.username and kafka.secret_properties)"
            )
        alerts = [e for e in errors if "tls alert" in e.str()]
        if alerts:  # the broker refused our client certificate (or its absence) during the handshake
            cert = (
                "a client certificate"
                if "ssl.certificate.location" in (properties or {})
                else "no client certificate"
            )
            raise KafkaError(
                f"Kafka at {bootstrap} refused our TLS client certificate: {alerts[-1].str()} (as "
                f"{principal(properties)}, {cert}; the listener takes certificates its CA signed, unexpired)"
            )
        tls = [e for e in errors if e.code() == ck.KafkaError._SSL]
        if tls:
            raise KafkaError(
                f"TLS with Kafka at {bootstrap} failed: {tls[-1].str()} (as {principal(properties)}; check "
                "kafka.client_properties ssl.ca.location / security.protocol, and a client certificate's CA)"
            )
        if time.monotonic() >= deadline:
            if probe.closed_after_tls and not (properties or {}).get("sasl.username"):
                raise KafkaError(
                    f"Kafka at {bootstrap} closes our connection after TLS, before answering: the listener "
                    "wants SASL credentials and we gave none (set sasl.mechanism, sasl.username and the "
                    "password: kafka.credentials)"
                )
            if probe.closed_before_answering:
                raise KafkaError(
                    f"Kafka at {bootstrap} accepts connections but closes them before answering: most "
                    "likely a security.protocol mismatch (a TLS/SASL listener: set "
                    "kafka.client_properties.security.protocol, e.g. SASL_SSL, and its sasl./ssl. properties)"
                )
            last = f"; last client error: {errors[-1].str()}" if errors else ""
            raise KafkaError(
                f"no Kafka broker answers at {bootstrap} (waited {timeout:.0f}s){last}: start one "
                "(`stream-rl kafka up`) or fix kafka.bootstrap / --bootstrap / $STREAM_RL_KAFKA_BOOTSTRAP"
                " (and kafka.client_properties for a secured cluster)"
            )
        time.sleep(0.3)
