"""A stand-in for an SGLang 0.5.23 server's weight-update routes, for tests/integration/test_sglang_over_gloo.py.

    python sglang_fake_server.py PORT [TP_SIZE]

NOT SGLang: an emulation, written from the 0.5.23 wheel (file:line there), of what our sender
relies on, with the collectives real (gloo instead of NCCL, one rank instead of tp_size: the
fake reports `tp_size` but joins as rank 1 only when it is 1):
- `GET /server_info`: flat server args (http_server.py:863-894).
- `POST /init_weights_update_group`: forms the group like SGLang's worker (rendezvous at
  tcp://master_address:master_port as rank rank_offset + 0, PrefixStore(group_name), torch's
  process-group helper; model_runner_components/weight_updater.py:100-144, utils/common.py:
  2859-2920) and answers once it stands; a name seen before fails as torch refuses it.
- `POST /begin_weight_update`, `/end_weight_update`: the session (scheduler_components/
  weight_updater.py:187-335: an update outside a session, a second begin, an end without begin
  all answer `success: false` with SGLang's messages).
- `POST /update_weights_from_distributed` with `load_format: "flattened_bucket"`: one uint8
  buffer laid out by weight_sync/tensor_bucket.py:86-133, received in one broadcast.
- `/pause_generation`, `/continue_generation`, `/update_weight_version`,
  `/destroy_weights_update_group`, and `GET /test_state` (the fake's own: what it received).
HTTP status as SGLang's: 200 on success, 400 with `{"success": false, "message"}` otherwise.
"""

from __future__ import annotations

import json
import sys
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torch.distributed import distributed_c10d as c10d

TIMEOUT = timedelta(seconds=20)


class State:
    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self.lock = threading.Lock()
        self.groups: dict[str, Any] = {}
        self.session = False
        self.paused: str | None = None
        self.label = "0"
        self.calls: list[str] = []
        self.weights: dict[str, list[float]] = {}


def join(body: dict[str, Any]) -> Any:
    name = body["group_name"]
    url = f"tcp://{body['master_address']}:{body['master_port']}"
    rank = body["rank_offset"] + 0
    store, _, _ = next(c10d.rendezvous(url, rank, body["world_size"], timeout=TIMEOUT))
    store.set_timeout(TIMEOUT)
    group, _ = c10d._new_process_group_helper(
        body["world_size"],
        rank,
        [],
        c10d.Backend("gloo"),
        c10d.PrefixStore(name, store),
        group_name=c10d.GroupName(name),
        timeout=TIMEOUT,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(body["world_size"])}
    return group


def receive(state: State, body: dict[str, Any]) -> tuple[bool, str]:
    if not state.session:
        return (
            False,
            "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
        )
    if body.get("load_format") != "flattened_bucket":
        return False, "this fake receives flattened buckets only"
    offset, layout = 0, []
    for name, dtype_name, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
        dtype = getattr(torch, dtype_name)
        if offset % dtype.itemsize:
            return False, f"Failed to receive weights: Unaligned received tensor {name}"
        size = int(torch.Size(shape).numel()) * dtype.itemsize
        layout.append((name, dtype, shape, offset, size))
        offset += size
    flat = torch.empty(offset, dtype=torch.uint8)
    torch.distributed.broadcast(flat, src=0, group=state.groups[body["group_name"]])
    for name, dtype, shape, start, size in layout:
        tensor = flat[start : start + size].view(dtype).reshape(shape)
        state.weights[name] = tensor.float().flatten().tolist()
    if body.get("weight_version") is not None:
        state.label = body["weight_version"]
    return True, "Succeeded to update parameter online."


def handle(state: State, path: str, body: dict[str, Any]) -> tuple[bool, str]:
    if path == "/init_weights_update_group":
        name = body["group_name"]
        if name in state.groups:
            return (
                False,
                "Failed to initialize custom process group: The specified group name has already been created.",
            )
        state.groups[name] = join(body)
        return True, "Succeeded to initialize custom process group."
    if path == "/destroy_weights_update_group":
        group = state.groups.pop(body["group_name"], None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        c10d.destroy_process_group(group)
        return True, "Succeeded to destroy custom process group."
    if path == "/begin_weight_update":
        if state.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        state.session = True
        return True, "Success"
    if path == "/end_weight_update":
        if not state.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        state.session = False
        return True, "Success"
    if path == "/update_weights_from_distributed":
        return receive(state, body)
    if path == "/pause_generation":
        state.paused = body.get("mode", "abort")
        return True, "Generation paused successfully."
    if path == "/continue_generation":
        state.paused = None
        return True, "Generation continued successfully."
    if path == "/update_weight_version":
        state.label = body["new_version"]
        return True, f"Weight version updated to {body['new_version']}"
    raise KeyError(path)


class Handler(BaseHTTPRequestHandler):
    state: State

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, data: Any) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        state = self.state
        if self.path == "/server_info":
            self._answer(200, {"tp_size": state.tp_size, "dp_size": 1, "pp_size": 1, "weight_version": "0"})
        elif self.path == "/test_state":
            with state.lock:
                data = {
                    "calls": state.calls,
                    "groups": sorted(state.groups),
                    "session": state.session,
                    "paused": state.paused,
                    "label": state.label,
                    "weights": state.weights,
                }
            self._answer(200, data)
        else:
            self._answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", 0))
        body = json.loads(self.rfile.read(length)) if length else {}
        state = self.state
        try:
            with state.lock:  # SGLang's scheduler handles one control request at a time
                state.calls.append(self.path)
                ok, message = handle(state, self.path, body)
        except KeyError:
            self._answer(404, {"detail": "Not Found"})
            return
        self._answer(200 if ok else 400, {"success": ok, "message": message})


def main(port: int, tp_size: int) -> None:
    Handler.state = State(tp_size)
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1)
