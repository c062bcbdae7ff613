"""What stream-rl hands vLLM 0.33, built against vLLM 0.33's own classes (no GPU, no server).

Marker `vllm033`: `make gpu-extra-check` runs these in the `gpu` extra's environment (vLLM 0.33.0,
torch 2.14, from uv.lock); the default run deselects them (vLLM is not in the dev environment).
vLLM 0.33 imports on a machine without CUDA, so everything here is its real code:

- the NCCL weight source (`_Tensors` as a `WeightSource`) and the trainer's init info;
- `VLLMWeightSender(backend="nccl")` driving vLLM's real `NCCLTrainerWeightTransferEngine`
  through our HTTP client, with the two CUDA-only steps (opening the NCCL communicator, the
  broadcast itself) replaced by CPU stand-ins that record what vLLM hands them;
- the `stream_rl_gloo` plugin against 0.33's worker-side engine base;
- the actor client's request bodies against 0.33's request models.

What this cannot check: NCCL itself, vLLM's worker receiving, CUDA graphs (`bench/gpu_vllm_check.sh`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from stream_rl.config import SamplingConfig
from stream_rl.errors import WeightSyncError
from stream_rl.inference.vllm_client import VLLMClient
from stream_rl.weights.adapters.vllm import INCOMPLETE, VLLMWeightSender, weight_source
from stream_rl.weights.server_client import ServerEndpoint

pytestmark = pytest.mark.vllm033

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm-0.32"
URL = "http://vllm-a:8000"
NO_SESSION = "finish_weight_update called without a matching start_weight_update."


@pytest.fixture(scope="module")
def vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:  # a failure, not a skip: this file is only selected where it must run
        pytest.fail(
            f"vLLM is not importable ({exc}): run these in the gpu extra's env (make gpu-extra-check)"
        )
    assert vllm.__version__.startswith("0.33"), vllm.__version__
    return vllm


def tensors(scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    return [
        ("model.embed_tokens.weight", torch.full((8, 4), scale)),
        ("model.layers.0.mlp.up_proj.weight", torch.full((6, 4), scale, dtype=torch.bfloat16)),
        ("lm_head.bias", torch.full((8,), scale)),
    ]


def test_our_weight_source_is_a_vllm_weight_source_whose_metadata_matches_its_iteration(vllm: Any) -> None:
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    source = weight_source()  # the class statement itself is checked by vLLM (metadata a cached_property)
    assert isinstance(source, WeightSource) and source.implements_iter_full()
    source.set(tensors())
    assert source.metadata == [
        ParamMeta("model.embed_tokens.weight", torch.float32, (8, 4)),
        ParamMeta("model.layers.0.mlp.up_proj.weight", torch.bfloat16, (6, 4)),
        ParamMeta("lm_head.bias", torch.float32, (8,)),
    ]
    sent = list(NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata))
    assert [name for name, _ in sent] == [name for name, _ in tensors()]
    source.set(tensors()[:2])  # a new push's tensors: the cached metadata follows
    assert len(source.metadata) == 2
    assert len(list(NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata))) == 2


class Recorder(VLLMWeightSender):
    """A sender whose HTTP calls are recorded and answered as vLLM 0.33's routes answer, and whose
    vLLM trainer engine is the real one minus its two CUDA steps."""

    def __init__(self, *, join_error: Exception | None = None, open_session: bool = False) -> None:
        super().__init__([ServerEndpoint(URL, "tok")], timeout_s=10.0, bucket_bytes=1 << 16)
        self.backend = "nccl"  # set after construction: the constructor wants CUDA for it
        self.calls: list[tuple[str, str, Any]] = []
        self.broadcasts: list[list[str]] = []
        self.opened: list[Any] = []
        self.join_error = join_error
        self.broadcast_error: Exception | None = None
        self.update_error: Exception | None = None
        self.session = open_session

    def call(self, server: ServerEndpoint, method: str, path: str, **kwargs: Any) -> Any:
        self.calls.append((method, path, kwargs.get("json", kwargs.get("params"))))
        if path == "/get_world_size":
            return {"world_size": 1}
        if path == "/start_weight_update":
            self.session = True
        if path == "/update_weights" and self.update_error is not None:
            self.session = False  # vLLM's worker ends the session when an update fails
            raise self.update_error
        if path == "/finish_weight_update":
            if not self.session:
                raise WeightSyncError(f"{method} {URL}{path}: HTTP 500: {NO_SESSION}")
            self.session = False
        return {}

    def _nccl_engine(self, info: Any, link: Any) -> Any:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

        assert WeightTransferTrainerFactory._registry[info.backend]() is NCCLTrainerWeightTransferEngine
        sender = self

        class OnCPU(NCCLTrainerWeightTransferEngine):
            def _open_trainer_endpoint(self, init_info: Any) -> None:
                if sender.join_error is not None:
                    raise sender.join_error
                sender.opened.append(init_info)

            def _broadcast(self, source: Any, meta: Any) -> None:
                if sender.broadcast_error is not None:
                    raise sender.broadcast_error
                sender.broadcasts.append([name for name, _ in self._checked_iter(source, meta)])

        return OnCPU.trainer_init(info, client=link, source=link.source)

    def paths(self) -> list[str]:
        return [path for _, path, _ in self.calls]


def test_the_nccl_path_drives_vllms_trainer_engine_in_the_order_and_bodies_vllm_expects(vllm: Any) -> None:
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    sender = Recorder()
    assert sender.connect() == {}
    init = next(body for _, path, body in sender.calls if path == "/init_weight_transfer_engine")
    worker = NCCLWeightTransferInitInfo(**init["init_info"])  # what vLLM's worker parses
    assert (worker.rank_offset, worker.world_size, worker.packed) == (1, 2, True)
    assert worker.packed_buffer_size_bytes == 1 << 16
    assert sender.opened[0].rank == 0 and sender.opened[0].world_size == 2
    # Recovery came first: the session closed (none was open), then the pause lifted.
    assert sender.paths()[:3] == ["/finish_weight_update", "/resume", "/get_world_size"]
    assert sender.calls[0][2] == {"weight_version": INCOMPLETE}

    sender.calls.clear()
    report = sender.push(3, tensors(), 1 << 16)
    assert report.updated == [URL] and report.failed == {}
    assert sender.paths() == [
        "/pause",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/resume",
    ]
    assert sender.calls[0][2] == {"mode": "keep", "clear_cache": "false"}
    update = NCCLWeightTransferUpdateInfo(**sender.calls[2][2]["update_info"])
    assert update.names == [name for name, _ in tensors()]
    assert update.dtype_names == ["float32", "bfloat16", "float32"]
    assert update.shapes == [[8, 4], [6, 4], [8]]
    assert sender.calls[3][2] == {"weight_version": "3"}
    assert sender.broadcasts == [update.names]

    sender.calls.clear()
    sender.push(4, tensors(2.0), 1 << 16)  # same names, dtypes and shapes: vLLM sends no metadata
    assert sender.calls[2][2]["update_info"] == asdict(NCCLWeightTransferUpdateInfo())
    assert sender.calls[3][2] == {"weight_version": "4"}
    assert len(sender.broadcasts) == 2


def test_an_engine_error_at_join_is_one_line_naming_vllm_its_version_and_the_step(vllm: Any) -> None:
    sender = Recorder(join_error=RuntimeError("NCCL error: unhandled system error\n(more)"))
    with pytest.raises(WeightSyncError) as failed:
        sender.connect()  # the only server: raises with every failure
    message = str(failed.value)
    assert (
        f"vLLM {vllm.__version__} nccl weight transfer: joining {URL} failed: RuntimeError: NCCL" in message
    )


@pytest.mark.parametrize("where", ["broadcast", "server"])
def test_a_failed_nccl_update_is_labelled_incomplete_before_decoding_resumes(vllm: Any, where: str) -> None:
    """Layers may be reloaded by then: the weights get the label our clients refuse, and only then
    does decoding resume. The broadcast fails (vLLM's session still open: finished under the label)
    or the server's update fails (vLLM ended the session: the label is set on its own)."""
    sender = Recorder()
    assert sender.connect() == {}
    sender.calls.clear()
    if where == "broadcast":
        sender.broadcast_error = RuntimeError("NCCL watchdog timeout")
    else:
        sender.update_error = WeightSyncError(f"POST {URL}/update_weights: HTTP 500: CUDA out of memory")
    report = sender.push(5, tensors(), 1 << 16)
    assert list(report.failed) == [URL]
    if where == "broadcast":
        assert (
            f"vLLM {vllm.__version__} nccl weight transfer: updating {URL} failed: RuntimeError"
            in report.failed[URL]
        )
        assert sender.paths()[-2:] == ["/finish_weight_update", "/resume"]
        assert sender.calls[-2][2] == {"weight_version": INCOMPLETE}
    else:
        assert "CUDA out of memory" in report.failed[URL]
        assert sender.paths()[-3:] == ["/finish_weight_update", "/update_weight_version", "/resume"]
        assert sender.calls[-2][2] == {"new_version": INCOMPLETE}
    assert not sender.session


def test_a_trainer_joining_after_a_dead_one_closes_its_session_under_the_incomplete_label(vllm: Any) -> None:
    sender = Recorder(open_session=True)  # a dead trainer's nccl update session is open
    assert sender.connect() == {}
    assert sender.paths()[:2] == ["/finish_weight_update", "/resume"]
    assert sender.calls[0][2] == {"weight_version": INCOMPLETE} and not sender.session


def test_the_gloo_plugin_is_a_vllm_033_weight_transfer_engine(vllm: Any) -> None:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from stream_rl.weights import vllm_engine
    from stream_rl.weights.vllm_guard import DISCARDED

    vllm_engine.register()
    engine_cls = WeightTransferEngineFactory._registry[vllm_engine.BACKEND]()
    assert engine_cls is vllm_engine.GlooWeightTransferEngine and issubclass(engine_cls, WeightTransferEngine)
    config = SimpleNamespace(parallel_config=SimpleNamespace(rank=0, world_size=1), model_config=None)
    engine = engine_cls(None, config, torch.device("cpu"), torch.nn.Linear(2, 2))
    # What our sender sends (stream_rl/weights/adapters/vllm.py), parsed as vLLM's worker does.
    init = engine.parse_init_info(
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "timeout_s": 5.0}
    )
    assert init.world_size == 2
    update = engine.parse_update_info(
        {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 2]], "bucket_bytes": 64}
    )
    assert [m.name for m in update.metas()] == ["w"]
    with pytest.raises(RuntimeError, match=DISCARDED):
        engine.update_weights({"discard": True})


def _client_bodies(prompt: Any) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    render = json.loads((DATA / "chat_render.json").read_text())

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append((request.url.path, body))
        if request.url.path.endswith("/render"):
            return httpx.Response(200, json=render if request.url.path.startswith("/v1/chat") else [render])
        return httpx.Response(200, json=json.loads((DATA / "generate.json").read_text()))

    client = VLLMClient(URL, http=httpx.AsyncClient(transport=httpx.MockTransport(handle)))
    sampling = SamplingConfig(temperature=0.7, max_tokens=6)
    asyncio.run(client.complete_many(prompt, sampling, n=2, seed=5))
    return calls


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "tokens"])
def test_the_clients_bodies_are_vllm_033_requests_and_keep_a_models_sampling_defaults_out(
    vllm: Any, chat: bool
) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    prompt: Any = [{"role": "user", "content": "12+3="}] if chat else [4, 9, 13]
    (render_path, render_body), (generate_path, generate_body) = _client_bodies(prompt)
    model = ChatCompletionRequest if chat else CompletionRequest
    assert render_path == ("/v1/chat/completions/render" if chat else "/v1/completions/render")
    assert not set(render_body) - set(model.model_fields), "fields vLLM 0.33 would ignore"
    request = model(**render_body)
    # A hub model's generation_config.json (Qwen2.5-Instruct's penalty, and a min_p) as vLLM 0.33
    # passes it when the server reads it: our explicit fields win.
    hub = {"repetition_penalty": 1.05, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": 0.5}
    params = request.to_sampling_params(6, hub)
    assert (params.repetition_penalty, params.min_p) == (1.0, 0.0)
    assert (params.presence_penalty, params.frequency_penalty) == (0.0, 0.0)
    assert params.temperature == 0.7 and params.top_p == 1.0
    assert generate_path == "/inference/v1/generate"
    assert not set(generate_body) - set(GenerateRequest.model_fields)
    assert GenerateRequest(**generate_body).token_ids == generate_body["token_ids"]
