"""Senders for engines other than ours, behind the `WeightSender` interface (GPU only, unverified).

- `vllm.VLLMWeightSender`: vLLM's native weight-transfer API (NCCL).
- `sglang.SGLangWeightSender`: SGLang's `/update_weights_from_distributed` (NCCL).
Import the submodule you need; vllm / sglang themselves are imported only when a group forms.
"""
