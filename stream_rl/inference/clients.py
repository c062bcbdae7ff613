"""The client of an inference server, by its engine: `make_client("vllm", url)`.

The base class and the built-in server's client are `stream_rl.inference.builtin_client`; vLLM's and
SGLang's build on them in `vllm_client.py` and `sglang_client.py`, so the choice among them lives
here, above all three.
"""

from __future__ import annotations

from stream_rl.config import ENGINES
from stream_rl.errors import ConfigError
from stream_rl.inference.builtin_client import BuiltinClient, InferenceClient


def make_client(
    engine: str, base_url: str, *, timeout_s: float = 120.0, api_key: str | None = None
) -> InferenceClient:
    """The client of a server of `engine` (`builtin`, `vllm`, `sglang`); with `api_key`, every call
    carries `Authorization: Bearer <api_key>`."""
    if engine == "builtin":
        return BuiltinClient(base_url, timeout_s=timeout_s, api_key=api_key)
    if engine == "vllm":
        from stream_rl.inference.vllm_client import VLLMClient

        return VLLMClient(base_url, timeout_s=timeout_s, api_key=api_key)
    if engine == "sglang":
        from stream_rl.inference.sglang_client import SGLangClient

        return SGLangClient(base_url, timeout_s=timeout_s, api_key=api_key)
    raise ConfigError(f"inference engine must be one of {', '.join(ENGINES)}, got {engine!r}")
