"""`Completion`: one model call's result, the one type every engine's client returns.

The actor, the multi-turn tasks (`ModelClient`) and the rollout builder all take this type;
each engine's client (`stream_rl.inference.client.make_client`) maps that engine's own response
fields into it, so nothing downstream knows which engine answered.

- `prompt_token_ids`: the prompt as the server tokenized it (chat template applied).
- `token_ids`: every sampled token, the end-of-sequence token included when the model emitted it.
- `logprobs[j]`: the behaviour logprob of `token_ids[j]` under `log_softmax(logits / T)`.
- `version_spans`: which weight version sampled which tokens (`stream_rl.contracts.VersionSpan`:
  from `start` on, until the next span), exactly as the engine recorded them.
- `text`: the decoded completion without special tokens (cut before a stop string).
- `finish_reason`: `stop` or `length`.
"""

from __future__ import annotations

from dataclasses import dataclass

from stream_rl.contracts.core import VersionSpan


@dataclass(slots=True)
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    version_spans: list[VersionSpan]
    text: str
    finish_reason: str
