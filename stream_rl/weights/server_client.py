"""HTTP calls from the trainer to one inference server's `/weights/*` endpoints.

Endpoints (the server contract; docs/engines.md "Weight sync"):
- `POST /weights/init_group` `{master_addr, master_port, rank, world_size, backend}`: the server
  joins the weight-sync group; answers once joined.
- `POST /weights/update` `{version, tensors: [{name, dtype, shape}], bucket_bytes}`: the server
  receives the broadcast buckets, installs them, answers `{version, receive_ms, stall_ms}`.
- `GET /weights/meta` -> `[{name, dtype, shape}]`; `GET /weights/version` -> `{version}`;
  `GET /weights/device` -> `{device, type, uuid}`.
- CUDA IPC (a server on the trainer's GPU; `stream_rl.weights.ipc`): `POST /weights/init_ipc`
  `{device_uuid, torch_version}`, `POST /weights/update_ipc` (an update plus `buckets`: handles).
Every call carries `Authorization: Bearer <token>` when the endpoint has an admin token.
Failures (unreachable, timeout, non-2xx, malformed answer) raise `WeightSyncError` naming the
server, the call and the cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from stream_rl.errors import WeightSyncError
from stream_rl.weights.buckets import TensorMeta


@dataclass
class ServerEndpoint:
    """An inference server as the trainer sees it: base URL and optional admin token."""

    url: str
    admin_token: str | None = None

    @property
    def base(self) -> str:
        return self.url.rstrip("/")


@dataclass(frozen=True)
class UpdateAnswer:
    version: int
    receive_ms: float
    stall_ms: float


class ServerClient:
    """The `/weights/*` calls to one server over a shared `httpx.Client` (thread-safe)."""

    def __init__(self, endpoint: ServerEndpoint, http: httpx.Client) -> None:
        self.endpoint = endpoint
        self._http = http
        self._headers = {"Authorization": f"Bearer {endpoint.admin_token}"} if endpoint.admin_token else {}

    def _call(self, method: str, path: str, timeout_s: float, body: dict[str, Any] | None = None) -> Any:
        url = f"{self.endpoint.base}{path}"
        try:
            response = self._http.request(
                method, url, json=body, headers=self._headers, timeout=max(timeout_s, 0.001)
            )
        except httpx.TimeoutException as exc:
            raise WeightSyncError(f"{method} {url}: no answer within {timeout_s:.1f} s") from exc
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 401:
            raise WeightSyncError(f"{method} {url}: 401 unauthorized (wrong or missing admin token)")
        if response.status_code >= 300:
            raise WeightSyncError(f"{method} {url}: HTTP {response.status_code}: {response.text[:300]}")
        try:
            return response.json()
        except ValueError as exc:
            raise WeightSyncError(f"{method} {url}: answer is not JSON: {response.text[:200]!r}") from exc

    def init_group(
        self,
        *,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
    ) -> None:
        body = {
            "master_addr": master_addr,
            "master_port": master_port,
            "rank": rank,
            "world_size": world_size,
            "backend": backend,
        }
        self._call("POST", "/weights/init_group", timeout_s, body)

    def meta(self, timeout_s: float) -> list[TensorMeta]:
        data = self._call("GET", "/weights/meta", timeout_s)
        if not isinstance(data, list):
            raise WeightSyncError(
                f"GET {self.endpoint.base}/weights/meta: expected a list, got {data!r:.200}"
            )
        return [TensorMeta.from_dict(item) for item in data]

    def device(self, timeout_s: float) -> dict[str, Any]:
        """`GET /weights/device`: `{"device", "type", "uuid"}`."""
        data = self._call("GET", "/weights/device", timeout_s)
        if not isinstance(data, dict) or "type" not in data:
            raise WeightSyncError(f"GET {self.endpoint.base}/weights/device: unexpected answer {data!r:.200}")
        return data

    def init_ipc(self, *, device_uuid: str, torch_version: str, timeout_s: float) -> None:
        body = {"device_uuid": device_uuid, "torch_version": torch_version}
        self._call("POST", "/weights/init_ipc", timeout_s, body)

    def update(
        self,
        *,
        version: int,
        metas: Sequence[TensorMeta],
        bucket_bytes: int,
        timeout_s: float,
        ipc_buckets: list[dict[str, Any]] | None = None,
    ) -> UpdateAnswer:
        """`POST /weights/update` (the buckets are broadcast meanwhile), or with `ipc_buckets`
        `POST /weights/update_ipc` (the buckets are shared CUDA memory)."""
        body: dict[str, Any] = {
            "version": version,
            "tensors": [m.to_dict() for m in metas],
            "bucket_bytes": bucket_bytes,
        }
        path = "/weights/update"
        if ipc_buckets is not None:
            body["buckets"] = ipc_buckets
            path = "/weights/update_ipc"
        data = self._call("POST", path, timeout_s, body)
        try:
            answer = UpdateAnswer(
                version=int(data["version"]),
                receive_ms=float(data["receive_ms"]),
                stall_ms=float(data["stall_ms"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightSyncError(f"POST {self.endpoint.base}{path}: malformed answer {data!r:.200}") from exc
        if answer.version != version:
            raise WeightSyncError(
                f"POST {self.endpoint.base}{path}: server installed version {answer.version}, expected {version}"
            )
        return answer

    def version(self, timeout_s: float) -> int | None:
        data = self._call("GET", "/weights/version", timeout_s)
        value = data.get("version") if isinstance(data, dict) else data
        return None if value is None else int(value)
