"""The trainer backend of a run: `PolicyTrainer` (`stream_rl.train.step`, plain torch) or, with
`trainer.backend: deepspeed`, `DeepSpeedTrainer` (`stream_rl.train.deepspeed_backend`, GPU only),
or with `fsdp2`, `FSDP2Trainer` (`stream_rl.train.fsdp_backend`).
All implement `TrainerBackend`; the trainer stage, `replay trainer` and the checkpoint rebuild
get theirs here, so the backends depend on `step` (the distributed ones also on
`stream_rl.train.ranks`, their shared rank protocol) and never on each other.
"""

from __future__ import annotations

from pathlib import Path

from stream_rl.config import RunConfig
from stream_rl.train.step import PolicyTrainer, TrainerBackend, configure_determinism, load_model


def build_trainer(config: RunConfig, weights: str | Path | None = None) -> TrainerBackend:
    """Determinism settings, then the model (`weights`, default `model.path`), the reference
    model when `kl_coef > 0` (always `model.path`: the initial policy), optimizer and schedule.
    With `trainer.backend: deepspeed` the result is a `DeepSpeedTrainer`, with `fsdp2` an
    `FSDP2Trainer` (same interface)."""
    tcfg = config.trainer
    if tcfg.backend == "deepspeed":
        from stream_rl.train.deepspeed_backend import build_deepspeed_trainer

        return build_deepspeed_trainer(config, weights)
    if tcfg.backend == "fsdp2":
        from stream_rl.train.fsdp_backend import build_fsdp2_trainer

        return build_fsdp2_trainer(config, weights)
    configure_determinism(tcfg.deterministic, tcfg.seed, tcfg.torch_threads)
    attn = config.model.attn_implementation
    path = weights if weights is not None else config.model.path
    adapter = None
    if tcfg.lora is not None:
        from stream_rl.train.lora import is_adapter

        if is_adapter(Path(path)):  # a LoRA checkpoint's model/: the base is model.path
            adapter, path = Path(path), config.model.path
    model = load_model(path, config.model.dtype, tcfg.device, attn)
    ref = None
    if tcfg.kl_coef > 0:
        ref = load_model(config.model.path, config.model.dtype, tcfg.device, attn).requires_grad_(False)
    temperature = config.actor.sampling.temperature
    if tcfg.lora is not None:
        from stream_rl.train.lora import LoraTrainer, wrap

        trainer = LoraTrainer(
            wrap(model, tcfg.lora), tcfg, temperature=temperature, device=tcfg.device, ref_model=ref
        )
        if adapter is not None:
            trainer.load_adapter(adapter)
        return trainer
    return PolicyTrainer(model, tcfg, temperature=temperature, device=tcfg.device, ref_model=ref)
