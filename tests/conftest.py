"""Shared fixtures and the suite's layout on pytest-xdist workers.

Integration tests share one real Kafka broker (started from the Maven-fetched jars on free ports
in a temp dir, or $STREAM_RL_TEST_BOOTSTRAP when set); each test gets its own run namespace, hence
fresh topics and consumer groups. Under xdist (`make test` runs `pytest -n ...`) the controller
starts that broker once and every worker uses it, instead of one JVM per worker.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stream_rl.kafka.topics import TopicNames

# Where PYTHONDONTWRITEBYTECODE is set (our machines; the Makefile's `setup` compiles stream_rl for
# that reason), pytest does not cache its assertion-rewritten test modules either: every run, each
# xdist worker parsed, rewrote and compiled all of them again (collecting tests/unit: 9.4 s of CPU
# per worker, 5.0 s with the cache). They are cached in tests/**/__pycache__ (git-ignored; pytest
# checks each file's mtime and size).
sys.dont_write_bytecode = False

REPO = Path(__file__).resolve().parents[1]
_BOOTSTRAP_ENV = "STREAM_RL_TEST_BOOTSTRAP"
_SHARED: dict[str, Any] = {}


BROKERLESS = ("unit", "unit or vllm033")
"""Marker expressions whose tests never need a broker (`make unit`, `make gpu-extra-check`)."""


def _is_xdist_controller(config: pytest.Config) -> bool:
    workers = getattr(config.option, "numprocesses", None)
    return workers not in (None, 0) and not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    """The xdist controller starts the shared broker before its workers exist (they inherit the
    environment), unless one is given or no selected test could need it (`-m unit`)."""
    if not _is_xdist_controller(config) or os.environ.get(_BOOTSTRAP_ENV):
        return
    if (config.option.markexpr or "").strip() in BROKERLESS:
        return
    import tempfile

    from stream_rl.common.ports import free_port
    from stream_rl.kafka.broker import LocalBroker

    data = Path(tempfile.mkdtemp(prefix="stream-rl-test-kafka-"))
    broker = LocalBroker(data, port=free_port())
    state = broker.up(quiet=True)
    _SHARED["broker"], _SHARED["data"] = broker, data
    os.environ[_BOOTSTRAP_ENV] = state.bootstrap


def pytest_unconfigure(config: pytest.Config) -> None:
    broker = _SHARED.pop("broker", None)
    if broker is not None:
        import shutil

        os.environ.pop(_BOOTSTRAP_ENV, None)
        broker.down(quiet=True)
        shutil.rmtree(_SHARED.pop("data"), ignore_errors=True)


# Where the suite's time goes (`make test --durations`, clean clone, 2 cores): the files that take
# minutes start first, so the run is not left waiting on one of them at its end.
# The longest work units first (each took 1.5-3.5 min in a clean-clone run), so no worker starts one
# near the end of the run and holds the suite's tail.
_FIRST = (
    "vllm",
    "tests/e2e/test_chaos.py",
    "tests/e2e/test_nemesis.py",
    "tests/docker/",
    "tests/integration/test_gpu_extra.py",
    "tests/integration/test_deepspeed_backend.py",
    "tests/e2e/test_cluster_chaos.py",
    "tests/integration/test_fsdp2_backend.py",
    "tests/e2e/",
    "tests/integration/test_secure",
    "tests/integration/",
)
_VLLM_FILES = ("tests/e2e/test_vllm_demo.py", "tests/integration/test_vllm.py")
"""The files whose tests use the session's vLLM server: one xdist work unit (one server per run)."""


def _unit(path: str) -> str:
    """The xdist work unit of the tests in file `path`: the file (its module fixtures are built
    once, on one worker), or `vllm` for the files on the session's vLLM server."""
    return "vllm" if path in _VLLM_FILES else path


def _rank(path: str) -> int:
    unit = _unit(path)
    return next((i for i, prefix in enumerate(_FIRST) if unit.startswith(prefix)), len(_FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if "vllm_server" in getattr(item, "fixturenames", ()) and path not in _VLLM_FILES:
            raise pytest.UsageError(f"{item.nodeid} uses vllm_server: add its file to _VLLM_FILES")
        if item.get_closest_marker("unit") is not None and not path.startswith("tests/unit/"):
            # `make unit` collects tests/unit only (importing the other tiers' modules cost each
            # worker ~1.7 s of CPU): a unit test elsewhere would never run there.
            raise pytest.UsageError(f"{item.nodeid} is marked unit: move it to tests/unit/")
    items.sort(key=lambda item: _rank(item.nodeid.split("::", 1)[0]))  # stable within a rank


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` (make test): a file per work unit, the vLLM files as one, in the order
    above (`--no-loadscope-reorder`). pytest-xdist's `loadgroup` would do it with marks, but it
    does not group on pytest 9.2 (pytest-dev/pytest-xdist#1386)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid.split("::", 1)[0])

    return FileScheduling(config, log)


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    existing = os.environ.get(_BOOTSTRAP_ENV)
    if existing:
        yield existing
        return
    from stream_rl.common.ports import free_port
    from stream_rl.kafka.broker import LocalBroker

    broker = LocalBroker(tmp_path_factory.mktemp("kafka"), port=free_port())
    state = broker.up(quiet=True)
    try:
        yield state.bootstrap
    finally:
        broker.down(quiet=True)


@pytest.fixture
def kafka(kafka_bootstrap: str):  # type: ignore[no-untyped-def]
    from stream_rl.kafka.confluent import KafkaTransport

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


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the vLLM server after the last test that needs it: idle, it still costs ~15% of a core
    (its engine loop polls), minutes of CPU over the rest of the suite."""
    if "vllm_server" in getattr(item, "fixturenames", ()) and (
        nextitem is None or "vllm_server" not in getattr(nextitem, "fixturenames", ())
    ):
        server = _VLLM.pop("server", None)
        if server is not None:
            server.stop()  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session) -> None:
    server = _VLLM.pop("server", None)
    if server is not None:
        server.stop()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The running vLLM server (`tests/vllm_fixture.VLLMServer`: url, model, log), started on first
    use (a minute or more on 2 cores; its tests are scheduled first)."""
    from vllm_fixture import VLLMServer

    server = _VLLM.get("server")
    if server is None:
        server = VLLMServer(tmp_path_factory.mktemp("vllm"))
        server.start_in_background()
        _VLLM["server"] = server
    try:
        server.wait()  # type: ignore[attr-defined]
    except RuntimeError as exc:
        pytest.fail(f"vLLM test server: {exc}")
    return server
