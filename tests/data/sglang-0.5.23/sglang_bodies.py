"""Write the recorded SGLang 0.5.23 responses of this directory with SGLang's own classes, and check
our request bodies against SGLang's own request classes. Needs SGLang 0.5.23 importable, which
needs no GPU: into a throwaway environment (never the project's `.venv`),

    uv venv /tmp/sgl-venv --python 3.11
    uv pip install --python /tmp/sgl-venv/bin/python --no-deps sglang==0.5.23
    uv pip install --python /tmp/sgl-venv/bin/python torch==2.13.0 numpy pydantic msgspec fastapi \
        orjson pybase64 requests ipython tqdm openai==2.8.0 psutil pillow packaging pyzmq aiohttp \
        transformers torchvision dill apache-tvm-ffi==0.1.11 sentencepiece compressed-tensors gguf \
        partial-json-parser
    /tmp/sgl-venv/bin/python tests/data/sglang-0.5.23/sglang_bodies.py write   # the response files
    /tmp/sgl-venv/bin/python tests/data/sglang-0.5.23/sglang_bodies.py check   # exit 0: all valid
    /tmp/sgl-venv/bin/python tests/data/sglang-0.5.23/sglang_bodies.py group .venv/bin/python

`write` builds each answer the way 0.5.23's serving code does (README.md here says which code);
`check` validates request_*.json (which tests/unit/test_sglang_client.py keeps equal to what our
client sends) and the sender's bodies (sender_bodies.json, sender_recovery.json; kept equal to
what it sends by tests/unit/test_sglang_sender.py) with SGLang's request classes; `group` forms a
gloo group between our trainer side (run by the given Python) and SGLang's own server-side helper.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

PROMPT = [151644, 872, 198, 3838, 374, 220, 18, 22, 10, 19, 20, 30, 151645, 198, 151644, 77091, 198]
OUTPUT = [18, 22, 10, 19, 20, 28, 23, 17, 151645]
TEXTS = ["3", "7", "+", "4", "5", "=", "8", "2", "<|im_end|>"]
LOGPROBS = [-0.0213, -0.0047, -0.3312, -0.0121, -0.0088, -0.0561, -1.2034, -0.2875, -0.0009]


def meta_info(rid: str, output: list[int], logprobs: list[float], switch_at: int) -> dict[str, Any]:
    """A finished request's meta_info as tokenizer_manager.py:2507-2567 builds it, with the
    weights relabelled from "3" to "4" after `switch_at` output tokens."""
    from sglang.srt.utils.weight_versions import (
        WeightVersionEvent,
        add_weight_versions_to_meta_info,
        compute_weight_version_spans,
    )

    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": {"type": "stop", "matched": output[-1]},
        "prompt_tokens": len(PROMPT),
        "weight_version": "4",
        "num_retractions": 0,
        "input_token_logprobs": [],
        "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(logprobs, output, strict=True)],
        "output_token_logprobs_length": len(output),
        "reasoning_tokens": 0,
        "completion_tokens": len(output),
        "cached_tokens": 0,
    }
    events = [WeightVersionEvent(old_version="3", num_output_tokens=switch_at)]
    spans = compute_weight_version_spans(events, current_version="4", num_output_tokens=len(output))
    add_weight_versions_to_meta_info(meta, spans, num_output_tokens=len(output))
    meta["e2e_latency"] = 0.183
    return meta


def chat_response() -> str:
    """serving_chat.py:2900-3051 for one choice with logprobs, return_token_ids, return_meta_info."""
    from sglang.srt.entrypoints.openai.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatCompletionTokenLogprob,
        ChatMessage,
        ChoiceLogprobs,
        UsageInfo,
    )
    from sglang.srt.utils.weight_versions import build_endpoint_weight_version_metadata

    meta = meta_info("a1b2c3d4e5f60718293a4b5c6d7e8f90", OUTPUT, LOGPROBS, switch_at=6)
    content = [
        ChatCompletionTokenLogprob(token=t, bytes=list(t.encode()), logprob=lp, top_logprobs=[])
        for t, lp in zip(TEXTS, LOGPROBS, strict=True)
    ]
    choice = ChatCompletionResponseChoice(
        index=0,
        message=ChatMessage(role="assistant", content="37+45=82"),
        logprobs=ChoiceLogprobs(content=content),
        finish_reason="stop",
        matched_stop=OUTPUT[-1],
        prompt_token_ids=PROMPT,
        response_token_ids=OUTPUT,
        meta_info=meta,
    )
    response = ChatCompletionResponse(
        id=meta["id"],
        created=1764582000,
        model="default",
        choices=[choice],
        usage=UsageInfo(
            prompt_tokens=len(PROMPT), completion_tokens=len(OUTPUT), total_tokens=len(PROMPT) + len(OUTPUT)
        ),
        metadata=build_endpoint_weight_version_metadata(meta),
    )
    return response.model_dump_json(by_alias=True)  # utils/json_response.py:34-41


def generate_response() -> str:
    """http_server.py:983-990 for a batch of two: a list of {text, output_ids, meta_info}
    (tokenizer_manager.py:2650-2655, 2190-2192), serialized as orjson does."""
    from sglang.srt.utils.json_response import dumps_json

    second = [18, 22, 10, 19, 20, 28, 23, 16, 151645]
    items = [
        {
            "text": "37+45=82",
            "output_ids": OUTPUT,
            "meta_info": meta_info("b0", OUTPUT, LOGPROBS, switch_at=6),
        },
        {
            "text": "37+45=81",
            "output_ids": second,
            "meta_info": meta_info("b1", second, LOGPROBS, switch_at=9),
        },
    ]
    return dumps_json(items).decode()


def write() -> None:
    files = {"chat_completion.json": chat_response(), "generate.json": generate_response()}
    files["model_info.json"] = json.dumps({"model_path": "Qwen/Qwen2.5-0.5B-Instruct", "weight_version": "4"})
    for name, text in files.items():
        (HERE / name).write_text(json.dumps(json.loads(text), indent=1) + "\n")
        print("wrote", name)


def check() -> None:
    from sglang.api.v1.api_types import GenerateRequest, SamplingParams
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
    from sglang.srt.managers import io_struct
    from sglang.srt.sampling.sampling_params import SamplingParams as EngineSamplingParams

    chat = json.loads((HERE / "request_chat.json").read_text())
    request = ChatCompletionRequest.model_validate(chat)
    assert request.return_token_ids and request.return_meta_info and request.logprobs
    assert request.model_fields_set >= set(chat), set(chat) - request.model_fields_set
    params = request.to_sampling_params(
        stop=request.stop or [], model_generation_config={"repetition_penalty": 1.05}
    )
    assert params["repetition_penalty"] == 1.0 and params["sampling_seed"] == chat["seed"]
    print("request_chat.json: a valid ChatCompletionRequest")

    gen = json.loads((HERE / "request_generate.json").read_text())
    GenerateRequest.from_json_value(gen)  # http_server.py:936-940, the /generate contract gate
    for p in gen["sampling_params"]:
        SamplingParams.from_json_value(p)  # unknown keys rejected
        engine = EngineSamplingParams(**p)
        engine.verify(vocab_size=151936)  # top_k: -1 or >= 1 (sampling_params.py:263-266)
    reqinput = io_struct.GenerateReqInput(**gen)
    reqinput.normalize_batch_and_arguments()
    assert reqinput.batch_size == len(gen["input_ids"]) and not reqinput.is_single
    print("request_generate.json: a valid /generate body and SamplingParams")

    try:
        EngineSamplingParams(top_k=0).verify(vocab_size=151936)
    except ValueError as exc:
        print("top_k: 0 is refused:", exc)
    else:
        raise AssertionError("top_k 0 accepted")

    ChatCompletionResponse.model_validate_json((HERE / "chat_completion.json").read_text())
    print("chat_completion.json: a valid ChatCompletionResponse")

    import msgspec

    classes = {
        "/init_weights_update_group": io_struct.InitWeightsUpdateGroupReqInput,
        "/update_weights_from_distributed": io_struct.UpdateWeightsFromDistributedReqInput,
        "/destroy_weights_update_group": io_struct.DestroyWeightsUpdateGroupReqInput,
        "/pause_generation": io_struct.PauseGenerationReqInput,
        "/continue_generation": io_struct.ContinueGenerationReqInput,
        "/begin_weight_update": io_struct.BeginWeightUpdateReqInput,
        "/end_weight_update": io_struct.EndWeightUpdateReqInput,
        "/update_weight_version": io_struct.UpdateWeightVersionReqInput,
    }
    from pydantic import TypeAdapter

    sequences = [
        json.loads((HERE / name).read_text()) for name in ("sender_bodies.json", "sender_recovery.json")
    ]
    for path, body in (call for sequence in sequences for call in sequence):
        if body is None:  # GET /server_info
            continue
        cls = classes[path]
        parsed = TypeAdapter(cls).validate_python(body)  # as FastAPI parses Body() (http_server.py)
        unknown = set(body) - {f.name for f in msgspec.structs.fields(cls)}
        assert not unknown, f"{path}: fields SGLang does not have: {unknown}"
        print(f"{path}: {parsed}")
    from pydantic import ValidationError

    for cls, bad in (
        (io_struct.PauseGenerationReqInput, {"mode": "wait"}),
        (io_struct.InitWeightsUpdateGroupReqInput, {}),
    ):
        try:
            TypeAdapter(cls).validate_python(bad)
        except ValidationError:
            print(f"{cls.__name__} refuses {bad} (the validation above is real)")
        else:
            raise AssertionError(f"{cls.__name__} accepted {bad}")


TRAINER = """
import sys, torch
from stream_rl.weights.adapters.sglang_group import TorchCollectives, pack, plan_buckets
port, name = int(sys.argv[1]), sys.argv[2]
c = TorchCollectives("gloo")
group = c.join(master_addr="127.0.0.1", master_port=port, world_size=2, group_name=name, timeout_s=600)
weights = [("a", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)), ("b", torch.tensor([1.5, -2.0]))]
for bucket in plan_buckets(weights, 1 << 20):
    c.broadcast(group, pack(bucket)).wait()
c.destroy(group)
"""


def group(trainer_python: str) -> None:
    """Our trainer side (`trainer_python`, the project's environment) against SGLang's own server
    side over gloo: its `init_custom_process_group` as rank 1 (what weight_updater.py:131-139
    calls) and its flattened-bucket receive (`FlattenedTensorBucket.empty`, `reconstruct_tensors`)."""
    import socket
    import subprocess
    from datetime import timedelta

    import torch
    from sglang.srt.utils import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    name = "stream-rl-crosscheck-1"
    repo = str(HERE.parents[2])
    trainer = subprocess.Popen([trainer_python, "-c", TRAINER, str(port), name], cwd=repo)
    pg = init_custom_process_group(
        backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1, group_name=name,
        timeout=timedelta(seconds=600),
    )  # fmt: skip
    received = {}
    for names, dtypes, shapes in ((["a"], ["bfloat16"], [[2, 3]]), (["b"], ["float32"], [[2]])):
        bucket = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
        torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
        received.update(dict(bucket.reconstruct_tensors()))
    assert trainer.wait(timeout=600) == 0
    torch.distributed.destroy_process_group(pg)
    assert received["a"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], received
    assert received["b"].tolist() == [1.5, -2.0], received
    print(
        f"group: our join_group/pack and SGLang's init_custom_process_group/FlattenedTensorBucket agree: {received}"
    )


if __name__ == "__main__":
    if sys.argv[1] == "group":
        group(sys.argv[2])
    else:
        {"write": write, "check": check}[sys.argv[1]]()
