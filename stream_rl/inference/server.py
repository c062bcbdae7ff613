"""The inference server: `stream-rl serve --model DIR [--port P] [--device cpu|cuda] ...`.

Consumes HTTP requests and weight broadcasts; produces completions. Routes:
- `POST /v1/chat/completions`, `POST /v1/completions`: openai_routes.py.
- `GET /v1/models` (the served model and its weight version), `GET /health` (200
  `{"status": "ok", "version"}` while the decode loop is alive, else 503), `GET /metrics`
  (Prometheus, metrics.py).
- `/weights/*` (admin token): weights_routes.py (process groups), ipc_routes.py (CUDA IPC).
Every `/v1/*` route requires `Authorization: Bearer <API key>` when the server has one
(`--api-key`, else $VLLM_API_KEY, as vLLM reads it; 401 otherwise); `/health` and `/metrics`
stay open (probes and Prometheus carry no key).
Invariants: binds 127.0.0.1 unless told; every error is a JSON body with a 4xx/5xx status,
never a crash; one engine thread decodes, the event loop only parses, queues and formats.

Run alone: `stream-rl make-model --out models/tiny && stream-rl serve --model models/tiny --port 8100`.
`--port 0` takes a free port; `--port-file F` writes the bound port to F (for launchers).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from stream_rl.common import heap
from stream_rl.config import InferenceConfig, ModelConfig, format_validation_error
from stream_rl.errors import ConfigError, StreamRLError
from stream_rl.inference import fault_hook, guards, ipc_routes, lora_routes, openai_routes, weights_routes
from stream_rl.inference.context import APIError, ReceiverFactory, ServerContext, validation_message
from stream_rl.inference.engine import SWAP_POLICIES, Engine, SwapPolicy
from stream_rl.inference.metrics import ServerMetrics

logger = logging.getLogger(__name__)
ADMIN_TOKEN_ENV = "STREAM_RL_ADMIN_TOKEN"
API_KEY_ENV = "VLLM_API_KEY"


def default_receiver_factory(**kwargs: Any) -> Any:
    from stream_rl.weights.receiver import WeightReceiver

    return WeightReceiver(**kwargs)


def create_app(
    engine: Engine,
    *,
    model_name: str,
    admin_token: str | None = None,
    api_key: str | None = None,
    receiver_factory: ReceiverFactory | None = None,
    weights_timeout_s: float = 60.0,
    max_body_bytes: int | None = None,
    model_aliases: tuple[str, ...] = (),
) -> FastAPI:
    """The FastAPI app around a (started or not) engine; the app's lifespan starts and stops it.
    `max_body_bytes` and the model names (`model_name` and `model_aliases`) are guards.py's.
    `api_key`: the key every `/v1/*` route requires (None: open)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            receiver = ctx.receiver
            if receiver is not None:
                receiver.close()
            engine.stop()

    app = FastAPI(title="stream-rl inference server", lifespan=lifespan, docs_url=None, redoc_url=None)
    ctx = ServerContext(
        engine=engine,
        model_name=model_name,
        metrics=ServerMetrics(engine),
        receiver_factory=receiver_factory or default_receiver_factory,
        admin_token=admin_token or None,
        api_key=api_key or None,
        weights_timeout_s=weights_timeout_s,
    )
    app.state.ctx = ctx
    app.state.model_names = {model_name, *model_aliases}
    limit = max_body_bytes if max_body_bytes is not None else guards.default_max_body_bytes(engine.max_len)
    app.add_middleware(guards.BodyLimit, limit=limit)
    app.add_exception_handler(StarletteHTTPException, guards.starlette_error)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = validation_message(exc.errors())
        ctx.metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": 400}},
            status_code=400,
        )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug must not take the server down or answer with a bare text page: log it, answer JSON.
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        body = {"error": {"message": f"internal error: {type(exc).__name__}: {exc}", "type": "server_error"}}
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.alive:
            return JSONResponse({"status": "ok", "version": engine.version})
        return JSONResponse(
            {"status": "error", "version": engine.version, "message": "engine loop not running"}, 503
        )

    def check_api_key(request: Request) -> None:
        ctx.check_api_key(request)

    @app.get("/v1/models", dependencies=[Depends(check_api_key)])
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "stream-rl",
            "max_model_len": engine.max_len,
            "version": engine.version,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    app.include_router(
        openai_routes.router, dependencies=[Depends(check_api_key), Depends(guards.check_model)]
    )
    app.include_router(weights_routes.router)
    app.include_router(ipc_routes.router)
    app.include_router(lora_routes.router)
    fault_hook.install(app)  # test-only, off unless $STREAM_RL_SERVER_FAULTS is set
    return app


def run(
    inference: InferenceConfig,
    model: ModelConfig,
    *,
    port: int,
    port_file: str | None = None,
    served_model_name: str | None = None,
    swap_policy: SwapPolicy = "in_flight",
    max_body_bytes: int | None = None,
    api_key: str | None = None,
) -> None:
    """Load the model, bind `inference.host:port` (0 = any free port) and serve until SIGTERM/SIGINT.
    `swap_policy`: when weight updates take effect (engine.py: in flight, or between sequences).
    `api_key`: the `/v1/*` routes' key (None: `inference.api_key_secret()`, else open)."""
    if api_key is None:
        secret = inference.api_key_secret()
        api_key = secret.get_secret_value() if secret else None
    import torch
    import uvicorn

    torch.set_num_threads(inference.torch_threads)
    engine = Engine.load(
        model.path,
        device=inference.device,
        dtype=model.dtype,
        attn_implementation=model.attn_implementation,
        max_batch=inference.max_batch,
        kv_policy=inference.kv_policy,
        swap_policy=swap_policy,
        seed=inference.seed,
        decode_shape=inference.decode_shape,
    )
    token = inference.admin_token.get_secret_value() if inference.admin_token else None
    app = create_app(
        engine,
        model_name=served_model_name or Path(model.path).name,
        admin_token=token,
        api_key=api_key,
        weights_timeout_s=inference.weights_timeout_s,
        max_body_bytes=max_body_bytes,
        model_aliases=(model.path, str(Path(model.path).resolve())),
    )
    sock = socket.socket(socket.AF_INET6 if ":" in inference.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((inference.host, port))
    except OSError as exc:
        raise StreamRLError(f"cannot bind {inference.host}:{port}: {exc.strerror}") from exc
    bound = sock.getsockname()[1]
    if port_file:
        tmp = Path(f"{port_file}.tmp")
        tmp.write_text(f"{bound}\n")
        tmp.replace(port_file)  # atomic: a reader never sees a partial number
    logger.info(
        "serving %s on http://%s:%d (%s; device %s, max batch %d, max length %d, KV cache up to %.0f MiB, "
        "kv policy %s, swap policy %s, decode shape %s)",
        model.path,
        inference.host,
        bound,
        "/v1/* need the API key" if api_key else "/v1/* open: no API key",
        inference.device,
        inference.max_batch,
        engine.max_len,
        engine.stats().kv_cache_max_bytes / 2**20,
        inference.kv_policy,
        swap_policy,
        inference.decode_shape,
    )
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    # uvicorn drains on SIGTERM, then re-raises the signal under the handler found at start;
    # a no-op one makes a requested stop exit 0 instead of dying by the signal.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    heap.settle()
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    logger.info("server stopped")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    d = InferenceConfig()
    parser.add_argument("--model", required=True, help="local Hugging Face model directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--attn-implementation",
        default="sdpa",
        choices=["eager", "sdpa", "flash_attention_2"],
        help="transformers attention kernels (flash_attention_2 needs flash-attn and CUDA)",
    )
    parser.add_argument("--host", default=d.host, help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=d.base_port, help="port (0 = any free port)")
    parser.add_argument("--port-file", help="write the bound port to this file once listening")
    parser.add_argument("--device", default=d.device, choices=["cpu", "cuda"])
    parser.add_argument(
        "--admin-token", help=f"bearer token required by /weights/* (default: ${ADMIN_TOKEN_ENV}, else none)"
    )
    parser.add_argument(
        "--api-key",
        help=f"bearer key required by /v1/* (default: ${API_KEY_ENV}, else none; prefer the variable: "
        "a command line is visible to other users in ps)",
    )
    parser.add_argument("--max-batch", type=int, default=d.max_batch, help="sequences decoded together")
    parser.add_argument("--kv-policy", default=d.kv_policy, choices=["keep", "recompute"])
    parser.add_argument(
        "--decode-shape",
        default=d.decode_shape,
        choices=["running", "fixed"],
        help="running: decode the running sequences; fixed: every slot, idle ones padded (a step "
        "costs the same at any occupancy: an accelerator's economics, emulated)",
    )
    parser.add_argument(
        "--swap-policy",
        default="in_flight",
        choices=SWAP_POLICIES,
        help="in_flight: new weights at the next decode step (running sequences included); "
        "between_sequences: hold admission, let running sequences finish, then swap",
    )
    parser.add_argument("--threads", type=int, default=d.torch_threads, help="torch intra-op threads")
    parser.add_argument("--served-model-name", help="model id in responses (default: the directory name)")
    parser.add_argument(
        "--weights-timeout", type=float, default=60.0, help="weight-sync collective timeout (s)"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of unseeded requests' sampling")
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="answer 413 to larger request bodies (default max(1 MiB, 64 bytes x the model's max length))",
    )


def main_serve(args: argparse.Namespace) -> int:
    token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("stream-rl serve: --api-key is empty (leave it out for open /v1/* routes)")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        inference = InferenceConfig(
            host=args.host,
            device=args.device,
            max_batch=args.max_batch,
            kv_policy=args.kv_policy,
            decode_shape=args.decode_shape,
            admin_token=token,
            torch_threads=args.threads,
            weights_timeout_s=args.weights_timeout,
            seed=args.seed,
        )
        model = ModelConfig(path=args.model, dtype=args.dtype, attn_implementation=args.attn_implementation)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "stream-rl serve")) from exc
    run(
        inference,
        model,
        port=args.port,
        port_file=args.port_file,
        served_model_name=args.served_model_name,
        swap_policy=args.swap_policy,
        max_body_bytes=args.max_body_bytes,
        api_key=api_key,
    )
    return 0
