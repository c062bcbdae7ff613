"""`POST /v1/chat/completions` and `POST /v1/completions`: OpenAI-compatible, so the official
`openai` client works unchanged, plus what RL needs: every choice carries `token_ids` (the
completion's ids, eos included) and `version_spans` (`[{"version", "start"}]`), the response
carries `prompt_token_ids`, and logprobs are those of sequence.py's contract.

Chat prompts are rendered with the model's chat template (`add_generation_prompt` true unless
told) and tokenized without adding special tokens. With `logprobs: true` each
`choices[i].logprobs.content[j]` has `token`, `logprob`, `bytes` and `top_logprobs`; `bytes`
are the token's own bytes (for byte-level tokenizers, a piece of a multi-byte character).
Without `max_tokens`, chat completions may run to the model's maximum length and completions
stop after 16 tokens (OpenAI's defaults). A request whose prompt plus `max_tokens` exceed the
model's maximum length (`max_model_len` in `GET /v1/models`) is refused with a 400 naming the
largest `max_tokens` that fits, as vLLM does; nothing is truncated silently.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request

from stream_rl.errors import InferenceError
from stream_rl.inference.context import ServerContext, api_error
from stream_rl.inference.engine import EngineStopped
from stream_rl.inference.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    SpanBody,
    TextChoice,
    TextCompletionRequest,
    TextCompletionResponse,
    TextLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from stream_rl.inference.requests import RequestResult, SamplingParams, SequenceResult

logger = logging.getLogger(__name__)
router = APIRouter()
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


async def _run(ctx: ServerContext, endpoint: str, prompt: list[int], params: SamplingParams) -> RequestResult:
    try:
        future = ctx.engine.submit(prompt, params)
    except EngineStopped as exc:
        ctx.metrics.requests.labels(endpoint, "503").inc()
        raise api_error(503, str(exc), "server_error") from exc
    except InferenceError as exc:
        ctx.metrics.requests.labels(endpoint, "400").inc()
        raise api_error(400, str(exc)) from exc
    try:
        result = await asyncio.wrap_future(future)
    except InferenceError as exc:
        ctx.metrics.requests.labels(endpoint, "503").inc()
        raise api_error(503, str(exc), "server_error") from exc
    ctx.metrics.requests.labels(endpoint, "200").inc()
    if logger.isEnabledFor(logging.DEBUG):
        finishes = ",".join(s.finish_reason for s in result.sequences)
        tokens = sum(len(s.token_ids) for s in result.sequences)
        logger.debug(
            "%s prompt=%d n=%d tokens=%d finish=%s", endpoint, len(prompt), params.n, tokens, finishes
        )
    return result


def _usage(result: RequestResult) -> Usage:
    prompt = len(result.prompt_token_ids)
    completion = sum(len(s.token_ids) for s in result.sequences)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _extensions(seq: SequenceResult) -> dict[str, Any]:
    """The fields every choice carries beside OpenAI's: token ids and version spans."""
    spans = [SpanBody(version=s.version, start=s.start) for s in seq.version_spans]
    return {
        "index": seq.index,
        "finish_reason": seq.finish_reason,
        "token_ids": seq.token_ids,
        "version_spans": spans,
    }


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> ChatCompletionResponse:
    ctx: ServerContext = request.app.state.ctx
    # OpenAI's "developer" role is the system role of templates that predate it.
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
    ]
    try:
        text = ctx.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tokenize=False
        )
    except (ValueError, TypeError) as exc:  # no template, or the template rejects the messages
        raise api_error(400, f"cannot apply the chat template: {exc}") from exc
    prompt = ctx.tokenizer.encode(text, add_special_tokens=False)
    top = (body.top_logprobs or 0) if body.logprobs else 0
    max_tokens = body.max_completion_tokens or body.max_tokens
    # Without max_tokens a chat completion may run to the model's length (as in vLLM).
    params = body.sampling(max_tokens, max(1, ctx.engine.max_len - len(prompt)), top)
    result = await _run(ctx, "chat", prompt, params)
    choices = [
        ChatChoice(
            message=AssistantMessage(content=seq.text),
            logprobs=ChatLogprobs(content=_chat_logprobs(ctx, seq, top)) if body.logprobs else None,
            **_extensions(seq),
        )
        for seq in result.sequences
    ]
    return ChatCompletionResponse(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=body.model or ctx.model_name,
        choices=choices,
        usage=_usage(result),
        prompt_token_ids=result.prompt_token_ids,
    )


def _chat_logprobs(ctx: ServerContext, seq: SequenceResult, top: int) -> list[TokenLogprob]:
    content = []
    for j, (token, logprob) in enumerate(zip(seq.token_ids, seq.logprobs, strict=True)):
        piece, raw = ctx.pieces.get(token)
        alternatives = []
        if top and seq.top_logprobs is not None:
            for alt, alt_logprob in seq.top_logprobs[j][:top]:
                alt_piece, alt_raw = ctx.pieces.get(alt)
                alternatives.append(TopLogprob(token=alt_piece, logprob=alt_logprob, bytes=alt_raw))
        content.append(TokenLogprob(token=piece, logprob=logprob, bytes=raw, top_logprobs=alternatives))
    return content


@router.post("/v1/completions")
async def completions(body: TextCompletionRequest, request: Request) -> TextCompletionResponse:
    ctx: ServerContext = request.app.state.ctx
    if isinstance(body.prompt, str):
        prompt = ctx.tokenizer.encode(body.prompt, add_special_tokens=False)
    else:
        prompt = list(body.prompt)
    top = body.logprobs or 0
    params = body.sampling(body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, top)
    result = await _run(ctx, "completions", prompt, params)
    choices = [
        TextChoice(
            text=seq.text,
            logprobs=_completion_logprobs(ctx, seq, top) if body.logprobs is not None else None,
            **_extensions(seq),
        )
        for seq in result.sequences
    ]
    return TextCompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=body.model or ctx.model_name,
        choices=choices,
        usage=_usage(result),
        prompt_token_ids=result.prompt_token_ids,
    )


def _completion_logprobs(ctx: ServerContext, seq: SequenceResult, top: int) -> TextLogprobs:
    tokens, offsets, tops = [], [], []
    offset = 0
    for j, token in enumerate(seq.token_ids):
        piece, _ = ctx.pieces.get(token)
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
        if top and seq.top_logprobs is not None:
            tops.append({ctx.pieces.get(alt)[0]: lp for alt, lp in seq.top_logprobs[j][:top]})
    return TextLogprobs(
        tokens=tokens, token_logprobs=seq.logprobs, top_logprobs=tops if top else None, text_offset=offsets
    )
