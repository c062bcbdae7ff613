"""Helpers for tests of anything that talks to an inference server (not used in production).

    with ServerThread(Engine.load(model_dir), admin_token="t") as server:
        httpx.get(f"{server.url}/health")

runs the real app with uvicorn in a background thread on a free 127.0.0.1 port and stops it
(and its engine) on exit.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from stream_rl.errors import InferenceError
from stream_rl.inference.context import ReceiverFactory
from stream_rl.inference.engine import Engine
from stream_rl.inference.server import create_app


class ServerThread:
    def __init__(
        self,
        engine: Engine,
        *,
        admin_token: str | None = None,
        api_key: str | None = None,
        receiver_factory: ReceiverFactory | None = None,
        model_name: str = "test-model",
        weights_timeout_s: float = 30.0,
        max_body_bytes: int | None = None,
    ) -> None:
        self.engine = engine
        self.app = create_app(
            engine,
            model_name=model_name,
            admin_token=admin_token,
            api_key=api_key,
            receiver_factory=receiver_factory,
            weights_timeout_s=weights_timeout_s,
            max_body_bytes=max_body_bytes,
        )
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise InferenceError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()


def random_weights(model: Any, seed: int, std: float = 0.2) -> list[tuple[str, Any]]:
    """New random tensors for every parameter of `model` (`named_parameters()` order, same dtypes):
    normals of `std` (norm weights around 1), large enough that greedy decoding varies."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    out = []
    for name, param in model.named_parameters():
        noise = torch.randn(tuple(param.shape), generator=generator)
        value = 1 + 0.1 * noise if "norm" in name else std * noise
        out.append((name, value.to(param.dtype)))
    return out


def load_weights(model: Any, named: list[tuple[str, Any]]) -> None:
    """Copy `named` tensors into `model`'s parameters (by name)."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in named:
            params[name].copy_(tensor)
