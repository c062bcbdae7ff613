"""What every confluent-kafka client of stream-rl shares: its librdkafka properties (secrets
unwrapped only here), its construction (a refused configuration as a one-line KafkaError), the
mapping of librdkafka's exceptions and `error_cb` to KafkaError, and calls bounded in time
(`Wedged` when librdkafka does not return)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard, TypeVar

import confluent_kafka as ck
from pydantic import SecretStr

from stream_rl.errors import KafkaError
from stream_rl.kafka.outage import CLIENT_LOG

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DEFAULT_COMPRESSION = "zstd"
log = logging.getLogger(
    "stream_rl.kafka.confluent"
)  # the name from before the split: log filters keep working


Properties = Mapping[str, str | SecretStr]
"""librdkafka properties from `kafka.client_properties` / `kafka.secret_properties` (secrets stay
`SecretStr` until the moment a client is built)."""


def client_conf(properties: Properties | None) -> dict[str, str]:
    """The properties as librdkafka takes them: secrets unwrapped (only here, into the client's
    own config; stream-rl never logs a client's config)."""
    return {k: v.get_secret_value() if isinstance(v, SecretStr) else v for k, v in (properties or {}).items()}


def base_conf(bootstrap: str, client_id: str, errors: ClientErrors) -> dict[str, Any]:
    """What every client of ours sets: where, who, our logger, and `errors` as the error callback."""
    return {"bootstrap.servers": bootstrap, "client.id": client_id, "logger": CLIENT_LOG, "error_cb": errors}


C = TypeVar("C")


def build_client(cls: Callable[[dict[str, Any]], C], conf: dict[str, Any]) -> C:
    """A librdkafka client, or a one-line KafkaError when librdkafka refuses its configuration
    (an unknown property, SASL without a username...): that is a mistake in kafka.client_properties."""
    try:
        return cls(conf)
    except ck.KafkaException as exc:
        err = exc.args[0] if exc.args else exc
        message = err.str() if isinstance(err, ck.KafkaError) else str(err)
        raise KafkaError(
            f"Kafka client configuration refused: {message} (check kafka.client_properties)"
        ) from exc


def fail(what: str, exc: ck.KafkaException) -> KafkaError:
    return KafkaError(f"{what}: {exc.args[0] if exc.args else exc}")


REFUSED_RESOURCE = {
    ck.KafkaError.TOPIC_AUTHORIZATION_FAILED: "topic",
    ck.KafkaError.GROUP_AUTHORIZATION_FAILED: "group",
    ck.KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: "transactional id",
    ck.KafkaError.CLUSTER_AUTHORIZATION_FAILED: "cluster",
}
"""The broker's authorization refusals, by the kind of resource refused."""


def principal(properties: Properties | None) -> str:
    """Who a client with `properties` is to the broker, as far as the client can tell: `User:<sasl
    username>`, the subject of its TLS certificate, or `User:ANONYMOUS`."""
    props = properties or {}
    user = props.get("sasl.username")
    if isinstance(user, str) and user:
        return f"User:{user}"
    cert = props.get("ssl.certificate.location")
    if isinstance(cert, str) and cert:
        import subprocess

        try:
            out = subprocess.run(
                ["openssl", "x509", "-noout", "-subject", "-nameopt", "RFC2253", "-in", cert],
                capture_output=True, text=True, timeout=5,
            ).stdout.strip()  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            out = ""
        subject = out.removeprefix("subject=").strip()
        cn = subject[3:] if subject.startswith("CN=") and "," not in subject else ""
        return f"User:{cn}" if cn else f"the holder of the certificate {cert}"
    return "User:ANONYMOUS"


def is_refusal(err: object) -> TypeGuard[ck.KafkaError]:
    return isinstance(err, ck.KafkaError) and err.code() in REFUSED_RESOURCE


def refusal(err: ck.KafkaError, who: str, operation: str, name: str = "") -> KafkaError:
    """The broker's authorization refusal as one line naming the principal and the right it lacks."""
    kind = REFUSED_RESOURCE[err.code()]
    target = "the cluster" if kind == "cluster" else f"{kind} {name}"
    return KafkaError(
        f"Kafka refused {who} {operation} on {target} ({err.name()}): that principal has no such "
        "ACL (`stream-rl acls plan` lists each principal's rights)"
    )


BOUNDED_GRACE_S = 5.0
"""How long past its own timeout a librdkafka call is waited for before it is abandoned (a call
that honours its timeout returns at it)."""


class Wedged(KafkaError):
    """A librdkafka call did not return: the client is unusable (any further transaction call
    conflicts with the abandoned one); the stage must exit and be restarted."""


def bounded(what: str, call: Callable[[float], None], timeout: float) -> None:
    """`call(timeout)` in a helper thread, abandoned with a KafkaError if it has not returned well
    after its timeout: right after a broker restart librdkafka's send_offsets_to_transaction was
    seen blocking for minutes past it (the preprocessor then hung; now it fails, and is restarted)."""
    import threading

    box: list[BaseException | None] = []

    def run() -> None:
        try:
            call(timeout)
            box.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
            box.append(exc)

    thread = threading.Thread(target=run, name=f"kafka-{what}", daemon=True)
    thread.start()
    thread.join(timeout + BOUNDED_GRACE_S)
    if not box:
        limit = timeout + BOUNDED_GRACE_S
        raise Wedged(f"{what}: librdkafka did not return within {limit:.0f}s (restart the stage)")
    if box[0] is not None:
        raise box[0]


class ClientErrors:
    """The `error_cb` of a client: fatal errors are kept (the next call raises them: a fenced
    static member's consumer otherwise just stops delivering, and its stage hangs); the others,
    mostly connection errors librdkafka recovers from, are logged rate-limited."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.fatal: str | None = None

    def __call__(self, err: ck.KafkaError) -> None:
        if err.fatal():
            self.fatal = err.str()
            log.error("%s: fatal Kafka client error: %s", self.client_id, err.str())
        else:
            CLIENT_LOG.log(logging.WARNING, "%s [%s] %s", "ERROR", self.client_id, err.str())

    def check(self, what: str) -> None:
        if self.fatal is not None:
            raise KafkaError(f"{what}: fatal Kafka client error (restart the stage): {self.fatal}")
