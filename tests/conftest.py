"""Shared fixtures. Integration tests share one real Kafka broker per session (started from the
Maven-fetched jars on free ports in a temp dir, or $STREAM_RL_TEST_BOOTSTRAP when set); each test
gets its own run namespace, hence fresh topics and consumer groups."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stream_rl.kafka.topics import TopicNames

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    existing = os.environ.get("STREAM_RL_TEST_BOOTSTRAP")
    if existing:
        yield existing
        return
    from stream_rl.kafka.broker import LocalBroker, free_port

    broker = LocalBroker(tmp_path_factory.mktemp("kafka"), port=free_port())
    state = broker.up(quiet=True)
    try:
        yield state.bootstrap
    finally:
        broker.down(quiet=True)


@pytest.fixture
def kafka(kafka_bootstrap: str):  # type: ignore[no-untyped-def]
    from stream_rl.kafka.client import KafkaTransport

    return KafkaTransport(kafka_bootstrap)


def new_run_id(prefix: str = "t") -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


@pytest.fixture
def run_names(kafka) -> TopicNames:  # type: ignore[no-untyped-def]
    """A fresh run namespace with all its topics created (2 partitions per scalable topic)."""
    from stream_rl.kafka.topics import apply_topics

    names = TopicNames(run=new_run_id())
    apply_topics(kafka, names, partitions=2)
    return names


# -- the session's vLLM server (tests marked `vllm`) ---------------------------------------------

_VLLM: dict[str, object] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the vLLM server in the background as soon as a selected test needs it: it takes a
    minute or more, and the other tests run meanwhile."""
    if any("vllm_server" in getattr(item, "fixturenames", ()) for item in session.items):
        from vllm_fixture import VLLMServer

        base = Path(session.config._tmp_path_factory.mktemp("vllm"))  # type: ignore[attr-defined]
        server = VLLMServer(base)
        server.start_in_background()
        _VLLM["server"] = server


def pytest_sessionfinish(session: pytest.Session) -> None:
    server = _VLLM.pop("server", None)
    if server is not None:
        server.stop()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def vllm_server() -> object:
    """The running vLLM server (`tests/vllm_fixture.VLLMServer`: url, model, log)."""
    server = _VLLM.get("server")
    if server is None:
        pytest.fail("the vLLM server was not started at collection (vllm_server used indirectly?)")
    try:
        server.wait()  # type: ignore[attr-defined]
    except RuntimeError as exc:
        pytest.fail(f"vLLM test server: {exc}")
    return server
