"""A fake inference server for weight-sync tests: the `/weights/*` contract, no model.

It holds zero-filled tensors described by `--metas` (a JSON file of `[{name, dtype, shape}]`),
receives updates with the real `WeightReceiver` into shadow buffers and swaps them in, like
the real server. Tests start it with `serve` in a forkserver child (torch is imported once);
as a script it prints `{"port": N}` on stdout once it serves.

Test-only extras: `GET /weights/checksum` -> `{"checksum", "version"}`; `--stall-updates` (accept
updates but never receive: a hung server); `--die-after N` (exit abruptly when the N-th tensor
of an update is requested: a crash in the middle of a transfer).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection
from typing import Any

import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights import TensorMeta, WeightReceiver, weights_checksum


class FakeWeightServer:
    def __init__(
        self, metas: list[TensorMeta], token: str | None, stall: bool, die_after: int | None
    ) -> None:
        self.metas = metas
        self.weights = {m.name: torch.zeros(m.shape, dtype=m.torch_dtype) for m in metas}
        self.version: int | None = None
        self.token = token
        self.stall = stall
        self.die_after = die_after
        self.receiver: WeightReceiver | None = None
        self.lock = threading.Lock()

    def init_group(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            if self.receiver is not None:
                self.receiver.close()
                self.receiver = None
            self.receiver = WeightReceiver(
                master_addr=body["master_addr"],
                master_port=int(body["master_port"]),
                rank=int(body["rank"]),
                world_size=int(body["world_size"]),
                backend=body["backend"],
                timeout_s=10.0,
            )
        return {"joined": True}

    def update(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.stall:
            time.sleep(3600)
        metas = [TensorMeta.from_dict(d) for d in body["tensors"]]
        shadow = {m.name: torch.empty(m.shape, dtype=m.torch_dtype) for m in metas}
        requested = 0

        def into(meta: TensorMeta) -> torch.Tensor:
            nonlocal requested
            requested += 1
            if self.die_after is not None and requested >= self.die_after:
                os._exit(17)
            return shadow[meta.name]

        with self.lock:
            if self.receiver is None:
                raise WeightSyncError("not in a weight-sync group")
            receive_ms = self.receiver.receive(metas, int(body["bucket_bytes"]), into)
            start = time.perf_counter()
            self.weights.update(shadow)
            self.version = int(body["version"])
            stall_ms = (time.perf_counter() - start) * 1000.0
        return {"version": self.version, "receive_ms": receive_ms, "stall_ms": stall_ms}

    def checksum(self) -> dict[str, Any]:
        named = [(m.name, self.weights[m.name]) for m in self.metas]
        return {"checksum": weights_checksum(named), "version": self.version}


def make_handler(server: FakeWeightServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
            pass

        def _reply(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            if server.token is None or self.headers.get("Authorization") == f"Bearer {server.token}":
                return True
            self._reply(401, {"detail": "unauthorized"})
            return False

        def do_GET(self) -> None:
            if not self._authorized():
                return
            if self.path == "/weights/meta":
                self._reply(200, [m.to_dict() for m in server.metas])
            elif self.path == "/weights/version":
                self._reply(200, {"version": server.version})
            elif self.path == "/weights/checksum":
                self._reply(200, server.checksum())
            else:
                self._reply(404, {"detail": "not found"})

        def do_POST(self) -> None:
            if not self._authorized():
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            routes = {"/weights/init_group": server.init_group, "/weights/update": server.update}
            if self.path not in routes:
                self._reply(404, {"detail": "not found"})
                return
            try:
                self._reply(200, routes[self.path](body))
            except WeightSyncError as exc:
                self._reply(500, {"detail": str(exc)})

    return Handler


def serve(
    metas: list[dict[str, Any]],
    *,
    port: int = 0,
    token: str | None = None,
    stall: bool = False,
    die_after: int | None = None,
    ready: Connection | None = None,
) -> None:
    """Serve until killed; announce the port on `ready` (or stdout)."""
    torch.set_num_threads(1)
    fake = FakeWeightServer([TensorMeta.from_dict(d) for d in metas], token, stall, die_after)
    httpd = ThreadingHTTPServer(("127.0.0.1", port), make_handler(fake))
    httpd.daemon_threads = True
    if ready is not None:
        ready.send(httpd.server_address[1])
        ready.close()
    else:
        print(json.dumps({"port": httpd.server_address[1]}), flush=True)
    httpd.serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--metas", required=True, help="JSON file: [{name, dtype, shape}]")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default=None)
    parser.add_argument("--stall-updates", action="store_true")
    parser.add_argument("--die-after", type=int, default=None)
    args = parser.parse_args()
    with open(args.metas) as f:
        metas = json.load(f)
    serve(metas, port=args.port, token=args.token, stall=args.stall_updates, die_after=args.die_after)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
