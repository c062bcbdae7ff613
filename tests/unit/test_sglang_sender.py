"""The SGLang sender's HTTP protocol against a fake SGLang (httpx.MockTransport) and fake
collectives: the exact calls and bodies of join, update (per pause policy), failure, recovery
and drop, and unique group names. The real group over gloo: tests/integration/test_sglang_over_gloo.py;
over NCCL against SGLang: tests/gpu/test_engine_adapters.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights import ServerEndpoint
from stream_rl.weights.adapters.sglang import INCOMPLETE, SGLangWeightSender
from stream_rl.weights.adapters.sglang_group import pack, plan_buckets

pytestmark = pytest.mark.unit

URL = "http://sglang:30000"
PREFIX = "stream-rl-0123456789ab"
DATA = Path(__file__).resolve().parents[1] / "data" / "sglang-0.5.23"
BODIES, RECOVERY = DATA / "sender_bodies.json", DATA / "sender_recovery.json"
WEIGHTS = [
    ("w", torch.arange(4, dtype=torch.bfloat16)),
    ("b", torch.ones(2, dtype=torch.bfloat16)),
    ("n", torch.ones(3, dtype=torch.float32)),
]


class Work:
    def __init__(self, done: bool, error: str | None = None) -> None:
        self.done, self.error = done, error

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        return True


class FakeCollectives:
    def __init__(self) -> None:
        self.joined: list[dict[str, Any]] = []
        self.sent: list[torch.Tensor] = []
        self.destroyed: list[str] = []
        self.complete = True
        self.error: str | None = None

    def join(self, **kwargs: Any) -> Any:
        self.joined.append(kwargs)
        return f"pg:{kwargs['group_name']}"

    def broadcast(self, group: Any, tensor: torch.Tensor) -> Work:
        self.sent.append(tensor.clone())
        return Work(self.complete, self.error)

    def destroy(self, group: Any) -> None:
        self.destroyed.append(group)


class FakeSGLang:
    """Answers as SGLang 0.5.23 does (200 / 400 with `{success, message}`); records every call."""

    def __init__(self, *, tp_size: int = 2, dp_size: int = 1, session_open: bool = False) -> None:
        self.info = {"tp_size": tp_size, "dp_size": dp_size, "pp_size": 1, "weight_version": "0"}
        self.session = session_open
        self.calls: list[tuple[str, Any]] = []
        self.headers: list[str | None] = []
        self.fail: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        self.calls.append((path, body))
        self.headers.append(request.headers.get("authorization"))
        if path == "/server_info":
            return httpx.Response(200, json=self.info)
        ok, message = True, "Success"
        if path in self.fail:
            ok, message = False, "Failed to receive weights: boom"
        elif path == "/begin_weight_update":
            ok, self.session = not self.session, True
        elif path == "/end_weight_update":
            ok, message = self.session, "no weight-update session is open; call begin_weight_update() first"
            self.session = False
        if path in ("/pause_generation", "/continue_generation"):
            return httpx.Response(200, json={"message": "ok", "status": "ok"})
        return httpx.Response(200 if ok else 400, json={"success": ok, "message": message})


def make(
    fake: FakeSGLang, pause: str = "keep", token: str | None = None
) -> tuple[SGLangWeightSender, FakeCollectives]:
    collectives = FakeCollectives()
    sender = SGLangWeightSender(
        [ServerEndpoint(URL, token)],
        master_addr="10.0.0.1",
        master_port=29600,
        timeout_s=5.0,
        pause=pause,
        collectives=collectives,
        transport=httpx.MockTransport(fake),
    )
    sender.group_prefix = PREFIX
    return sender, collectives


def paths(fake: FakeSGLang) -> list[str]:
    return [path for path, _ in fake.calls]


def test_join_update_close_send_exactly_the_bodies_validated_against_sglang() -> None:
    fake = FakeSGLang(tp_size=2)
    sender, collectives = make(fake, token="secret")
    assert sender.connect() == {}
    assert collectives.joined == [
        {
            "master_addr": "10.0.0.1",
            "master_port": 29600,
            "world_size": 3,
            "group_name": f"{PREFIX}-1",
            "timeout_s": 5.0,
        }
    ]
    report = sender.push(7, WEIGHTS, bucket_bytes=1 << 20)
    assert report.updated == [URL] and report.failed == {}
    assert set(report.per_server[URL]) == {"receive_ms", "stall_ms", "total_ms"}
    sender.close()
    # The sequence (and every body) is sender_bodies.json, which sglang_bodies.py check validates
    # with SGLang's own request classes.
    assert [list(call) for call in fake.calls] == json.loads(BODIES.read_text())
    assert set(fake.headers) == {"Bearer secret"}
    # Buckets: one dtype each, packed in order; the last carries the version label.
    assert [t.tolist() for t in collectives.sent] == [
        pack(b).tolist() for b in plan_buckets(WEIGHTS, 1 << 20)
    ]
    assert collectives.destroyed == [f"pg:{PREFIX}-1"]


@pytest.mark.parametrize(
    ("pause", "expected"),
    [
        ("keep", ["pause:in_place", "/begin_weight_update"]),
        ("recompute", ["pause:retract", "/begin_weight_update"]),
        # drain: begin first (SGLang's writer lock waits for running requests), then retract stragglers
        ("drain", ["/begin_weight_update", "pause:retract"]),
    ],
)
def test_the_pause_follows_the_policy_and_generation_resumes(pause: str, expected: list[str]) -> None:
    fake = FakeSGLang()
    sender, _ = make(fake, pause=pause)
    sender.connect()
    fake.calls.clear()
    sender.push(1, WEIGHTS[:1], bucket_bytes=1 << 20)
    steps = [f"pause:{body['mode']}" if path == "/pause_generation" else path for path, body in fake.calls]
    assert steps == [
        *expected,
        "/update_weights_from_distributed",
        "/end_weight_update",
        "/continue_generation",
    ]
    sender.close()


def test_buckets_split_by_size_and_dtype_and_only_the_last_is_labelled() -> None:
    fake = FakeSGLang()
    sender, collectives = make(fake)
    sender.connect()
    fake.calls.clear()
    sender.push(5, WEIGHTS, bucket_bytes=6)  # w (8 bytes) alone, b (4), n (float32)
    updates = [body for path, body in fake.calls if path == "/update_weights_from_distributed"]
    assert [u["names"] for u in updates] == [["w"], ["b"], ["n"]]
    assert [u.get("weight_version") for u in updates] == [None, None, "5"]
    assert all(u["load_format"] == "flattened_bucket" and u["flush_cache"] is False for u in updates)
    assert [len(t) for t in collectives.sent] == [8, 4, 12]
    sender.close()


def test_a_failed_update_labels_the_weights_incomplete_resumes_and_drops_the_server() -> None:
    fake = FakeSGLang()
    sender, collectives = make(fake)
    sender.connect()
    fake.calls.clear()
    fake.fail.add("/update_weights_from_distributed")
    collectives.complete = False  # the server left the broadcast: our side never completes
    report = sender.push(2, WEIGHTS, bucket_bytes=1 << 20)
    assert report.updated == [] and "boom" in report.failed[URL]
    assert sender.live_servers == []
    sender.close()  # waits for the background release
    steps = paths(fake)
    assert steps[:3] == ["/pause_generation", "/begin_weight_update", "/update_weights_from_distributed"]
    assert ("/update_weight_version", {"new_version": INCOMPLETE, "abort_all_requests": False}) in fake.calls
    assert steps.index("/update_weight_version") < steps.index("/continue_generation")
    assert ("/destroy_weights_update_group", {"group_name": f"{PREFIX}-1"}) in fake.calls
    assert collectives.destroyed == [f"pg:{PREFIX}-1"]


def test_a_failed_collective_is_a_dropped_server_not_a_crashed_trainer() -> None:
    fake = FakeSGLang()
    sender, collectives = make(fake)
    sender.connect()
    collectives.error = "NCCL error: remote process exited"
    report = sender.push(2, WEIGHTS, bucket_bytes=1 << 20)
    assert "remote process exited" in report.failed[URL] and sender.live_servers == []
    sender.close()
    assert ("/update_weight_version", {"new_version": INCOMPLETE, "abort_all_requests": False}) in fake.calls
    assert paths(fake)[-1] == "/destroy_weights_update_group"


def test_join_recovers_an_update_a_dead_trainer_left_open() -> None:
    fake = FakeSGLang(session_open=True)
    sender, _ = make(fake)
    assert sender.connect() == {}
    assert paths(fake) == [
        "/server_info",
        "/end_weight_update",  # closes the dead trainer's session
        "/update_weight_version",  # its weights may be half updated: not a version
        "/continue_generation",
        "/init_weights_update_group",
    ]
    assert fake.calls[2][1] == {"new_version": INCOMPLETE, "abort_all_requests": False}
    sender.close()
    assert [list(call) for call in fake.calls] == json.loads(RECOVERY.read_text())  # validated against SGLang


def test_group_names_are_unique_per_trainer_process_and_per_join() -> None:
    # Two trainer processes: each sender draws its own random prefix.
    one, two = (
        SGLangWeightSender(
            [ServerEndpoint(URL)], collectives=FakeCollectives(), transport=httpx.MockTransport(FakeSGLang())
        )
        for _ in range(2)
    )
    assert re.fullmatch(r"stream-rl-[0-9a-f]{12}", one.group_prefix) and one.group_prefix != two.group_prefix
    one.close()
    two.close()
    # One process: a server dropped and re-joined gets a new name (SGLang refuses a name twice).
    fake = FakeSGLang()
    sender, collectives = make(fake)
    sender.connect()
    sender.push(1, WEIGHTS[:1], 1 << 20)
    fake.fail.add("/update_weights_from_distributed")
    assert sender.push(2, WEIGHTS[:1], 1 << 20).failed  # dropped
    fake.fail.clear()
    assert sender.connect() == {}
    assert [j["group_name"] for j in collectives.joined] == [f"{PREFIX}-1", f"{PREFIX}-2"]
    sender.close()


@pytest.mark.parametrize(
    ("info", "match"), [({"dp_size": 2}, "dp_size is 2"), ({"pp_size": 2}, "pp_size is 2")]
)
def test_data_or_pipeline_parallel_servers_are_refused_with_a_clear_error(
    info: dict[str, int], match: str
) -> None:
    fake = FakeSGLang()
    fake.info.update(info)
    sender, collectives = make(fake)
    with pytest.raises(WeightSyncError, match=match):
        sender.connect()
    assert collectives.joined == [] and paths(fake) == ["/server_info"]
    sender.close()


def test_bad_pause_policies_and_cpu_only_machines_are_refused() -> None:
    with pytest.raises(WeightSyncError, match="pause policy"):
        SGLangWeightSender([ServerEndpoint(URL)], pause="wait", collectives=FakeCollectives())
    if not torch.cuda.is_available():
        with pytest.raises(WeightSyncError, match="needs CUDA"):
            SGLangWeightSender([ServerEndpoint(URL)])


def test_plan_buckets_keep_order_one_dtype_each_and_pack_is_the_bytes_in_order() -> None:
    buckets = plan_buckets(WEIGHTS, bucket_bytes=1 << 20)
    assert [[n for n, _ in b] for b in buckets] == [["w", "b"], ["n"]]
    flat = pack(buckets[0])
    assert flat.dtype == torch.uint8 and len(flat) == 12
    assert torch.equal(flat[:8].view(torch.bfloat16), WEIGHTS[0][1])
    assert plan_buckets([], 10) == []
