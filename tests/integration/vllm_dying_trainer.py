"""A trainer that joins a vLLM server, gets half-way through an update, says where it is on stdout,
and waits to be SIGKILLed (tests/integration/test_vllm.py).

    python vllm_dying_trainer.py URL TOKEN paused|broadcasting|received [MODEL_DIR]

- `paused`: the server is paused (`POST /pause?mode=keep&clear_cache=false`), nothing sent.
- `broadcasting`: `/start_weight_update` and `/update_weights` are accepted and the first of many
  buckets is broadcast; the server waits for the rest (its receive times out after 5 s).
- `received`: the model in MODEL_DIR, perturbed as the test's `perturbed(MODEL_DIR, DEAD_SEED)`,
  is sent whole (the server holds it in its shadow buffers) and the server paused: killed between
  update and finish.
"""

from __future__ import annotations

import sys
import time

import torch

from stream_rl.weights.adapters.vllm import VLLMWeightSender
from stream_rl.weights.buckets import TensorMeta, plan_buckets
from stream_rl.weights.server_client import ServerEndpoint

DEAD_SEED = 6


def perturbed(model_dir: str, seed: int, scale: float = 0.05) -> torch.nn.Module:
    """As tests/integration/test_vllm.py's (this script runs on its own)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def main(url: str, token: str, stage: str, model_dir: str = "") -> None:
    server = ServerEndpoint(url, token)
    sender = VLLMWeightSender([server], timeout_s=5.0)
    if sender.connect():
        raise SystemExit("could not join")
    if stage == "paused":
        sender.call(server, "POST", "/pause", params={"mode": "keep", "clear_cache": "false"})
    elif stage == "received":
        model = perturbed(model_dir, DEAD_SEED)
        sender.send(server, sender._servers[url].handle, list(model.named_parameters()), 1 << 16)
        sender.call(server, "POST", "/pause", params={"mode": "keep", "clear_cache": "false"})
    else:
        group = sender._servers[url].handle
        tensors = [torch.zeros(4096) for _ in range(8)]
        metas = [TensorMeta(f"t{i}", "float32", (4096,)) for i in range(8)]
        info = {
            "names": [m.name for m in metas],
            "dtype_names": [m.dtype for m in metas],
            "shapes": [list(m.shape) for m in metas],
            "bucket_bytes": 4096 * 4,
        }
        sender.call(server, "POST", "/start_weight_update")
        sender.call(server, "POST", "/update_weights", json={"update_info": info})
        first = plan_buckets(metas, 4096 * 4)[0]
        assert len(first) == 1
        group.broadcast(tensors[0].view(torch.uint8), 5.0).wait()
    print(stage.upper(), flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(*sys.argv[1:5])
