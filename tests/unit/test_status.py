"""`stream-rl status`: the per-server rows (version held, versions behind the trainer, what the last
push did), read from servers' real `/metrics` endpoints over HTTP."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from stream_rl.common.ports import free_port
from stream_rl.contracts import WeightVersion, WeightVersionKind
from stream_rl.observe.status import StatusView

pytestmark = pytest.mark.unit


def _metrics_server(version: int) -> tuple[http.server.HTTPServer, str]:
    body = (
        "# TYPE stream_rl_inference_weight_version gauge\n"
        f"stream_rl_inference_weight_version {version}\n"
        "# TYPE stream_rl_inference_engine_up gauge\nstream_rl_inference_engine_up 1\n"
        "# TYPE stream_rl_inference_running gauge\nstream_rl_inference_running 3\n"
        "# TYPE stream_rl_inference_waiting gauge\nstream_rl_inference_waiting 1\n"
    ).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200 if self.path in ("/metrics", "/health") else 404)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def servers() -> Iterator[list[str]]:
    started = [_metrics_server(7), _metrics_server(4)]
    yield [url for _s, url in started]
    for s, _url in started:
        s.shutdown()


def test_server_rows_say_how_far_behind_each_server_is(servers: list[str]) -> None:
    current, lagging = servers
    gone = f"http://127.0.0.1:{free_port()}"
    wv = WeightVersion(
        "r", 7, 7, WeightVersionKind.UPDATE, 0, 0, "c", servers_updated=[current], servers_failed=[lagging]
    )
    rows = StatusView.server_rows([current, lagging, gone], wv)
    assert rows[0] == ("server", "health", "version", "behind", "last push", "running", "waiting", "tokens/s")
    assert rows[1] == (current, "ok", "7", "0", "ok", "3", "1", "0")
    assert rows[2] == (lagging, "ok", "4", "3", "failed", "3", "1", "0")
    assert rows[3] == (gone, "DOWN", "-", "-", "-", "-", "-", "-")
    before_any = StatusView.server_rows([current], None)
    assert before_any[1][2:5] == ("7", "-", "-")


def test_the_server_table_names_how_each_server_is_a_member(servers: list[str]) -> None:
    from fakes.records import make_membership

    current, lagging = servers
    members = {
        m.url: m
        for m in (
            make_membership(lagging, "draining"),
            make_membership("http://10.0.0.9:1", "joined"),
            make_membership("http://10.0.0.8:1", "left"),
        )
    }
    membership = StatusView.membership([current, lagging], members)
    assert membership == {current: "config", lagging: "draining", "http://10.0.0.9:1": "joined"}
    rows = StatusView.server_rows([current], None, membership)
    assert rows[0][:3] == ("server", "member", "health") and rows[1][:3] == (current, "config", "ok")
