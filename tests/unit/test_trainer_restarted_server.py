"""A server killed and restarted right after a push, while the trainer lives (issue 15 item 2):
no push failed on it, so the trainer's sender still takes it for holding that version. The trainer
asks its live servers which version they hold while idle (`push.drop_restarted`), drops the one
that reports an older version, re-joins it and pushes it the current version. The servers here
are tiny HTTP fakes answering the built-in server's `GET /v1/models` and `GET /health`."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fakes.training import FakePusher, FakeReport, make_batches, make_tiny_model, setup_topics, stage_config

from stream_rl.config import RunConfig, ServerConfig
from stream_rl.kafka.memory import MemoryTransport
from stream_rl.kafka.stage import StopFlag
from stream_rl.stages import trainer as trainer_stage
from stream_rl.train import push as push_module
from stream_rl.train import server_sync

pytestmark = pytest.mark.unit


class FakeServer:
    """Answers `GET /v1/models` with `version` (or `body` when set) and `GET /health` with 200."""

    def __init__(self) -> None:
        self.version = 0
        self.body: bytes | None = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path == "/v1/models":
                    body = fake.body or json.dumps({"data": [{"id": "m", "version": fake.version}]}).encode()
                elif self.path == "/health":
                    body = json.dumps({"status": "ok", "version": fake.version}).encode()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers() -> Iterator[tuple[FakeServer, FakeServer]]:
    a, b = FakeServer(), FakeServer()
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


class ServingPusher(FakePusher):
    """`FakePusher` whose pushes install into the fake servers; `restart_after` = version V: the
    second server is killed and restarted right after the push of V (it serves version 0 again,
    and no push failed to say so)."""

    def __init__(self, servers: Sequence[FakeServer], restart_after: int) -> None:
        super().__init__()
        self.servers = {s.url: s for s in servers}
        self.urls = list(self.servers)
        self.restart_after: int | None = restart_after
        self.dropped: list[str] = []
        self.stop = StopFlag()
        """Set once a version is pushed twice (the re-push): the run is over."""

    def push(self, version: int, named_tensors: Sequence[tuple[str, Any]], bucket_bytes: int) -> FakeReport:
        report = super().push(version, named_tensors, bucket_bytes)
        for url in self.live:
            self.servers[url].version = version
        if version == self.restart_after:
            self.servers[self.urls[1]].version = 0
            self.restart_after = None
        if [v for v, _ in self.pushed].count(version) > 1:
            self.stop.set("re-pushed")
        return report

    def drop(self, url: str) -> bool:
        if url not in self.live:
            return False
        self.live.remove(url)
        self.dropped.append(url)
        return True

    def connect(self) -> dict[str, str]:
        self.live = [u for u in self.urls if u in self.live] + [u for u in self.urls if u not in self.live]
        return {}


def served_config(tmp_path: Path, model_dir: Path, servers: Sequence[FakeServer]) -> RunConfig:
    cfg = stage_config(tmp_path, model_dir, max_steps=3)
    data = cfg.model_dump()
    data["inference"] = {"servers": [{"url": s.url} for s in servers]}
    return RunConfig.model_validate(data)


def test_a_server_restarted_right_after_a_push_is_re_pushed_while_idle(
    tmp_path: Path, model_dir: Path, servers: tuple[FakeServer, FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = MemoryTransport()
    setup_topics(transport, "r1", make_batches(2, 2, seed=3))  # one step: version 1, then idle
    pusher = ServingPusher(servers, restart_after=1)
    monkeypatch.setattr(server_sync, "RECONNECT_EVERY_S", 0.0)
    config = served_config(tmp_path, model_dir, servers)
    stats = trainer_stage.run(config, transport, pusher=pusher, stop=pusher.stop, idle_timeout_s=5.0)
    a, b = servers
    assert stats.version == 1
    # Version 1 went to both; b restarted right after it, was found holding 0 while the trainer
    # idled, dropped, re-joined and pushed version 1 again; a was never dropped.
    assert [v for v, _ in pusher.pushed] == [0, 1, 1], pusher.pushed
    assert pusher.pushed[1][1] == pusher.pushed[2][1]
    assert pusher.dropped == [b.url]
    assert (a.version, b.version) == (1, 1)
    assert sorted(pusher.live) == sorted([a.url, b.url])
    assert stats.restarted_servers == 1


def test_only_live_servers_that_report_an_older_version_are_dropped() -> None:
    pusher = ServingPusher([], restart_after=-1)
    pusher.urls = ["http://a:1", "http://b:2"]
    pusher.connect()
    held: dict[str, int | None] = {"http://a:1": 3, "http://b:2": 2, "http://c:3": 0}
    servers = [ServerConfig(url=u, engine="builtin") for u in (*held, "http://d:4")]
    asked: list[list[str]] = []

    def probe(targets: Sequence[ServerConfig]) -> dict[str, int | None]:
        asked.append([s.url for s in targets])
        return {s.url: held.get(s.url) for s in targets}

    # a holds the pushed version, b an older one; c and d are not live (already dropped or never
    # joined): they are not asked. A server that gives no answer (None) is left alone.
    assert push_module.drop_restarted(pusher, servers, 3, probe) == ["http://b:2"]
    assert asked == [["http://a:1", "http://b:2"]] and pusher.dropped == ["http://b:2"]
    pusher.connect()
    held["http://b:2"] = None
    assert push_module.drop_restarted(pusher, servers, 3, probe) == []
    assert pusher.live_servers == ["http://a:1", "http://b:2"]


def test_held_versions_reads_each_server_and_never_raises(servers: tuple[FakeServer, FakeServer]) -> None:
    a, b = servers
    a.version, b.body = 7, b"not json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    got = push_module.held_versions(
        [ServerConfig(url=u, engine="builtin") for u in (a.url, b.url, closed)], timeout_s=10.0
    )
    assert got == {a.url: 7, b.url: None, closed: None}
