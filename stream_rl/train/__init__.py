"""The trainer's model side (torch), used by the `trainer` stage and `replay trainer`.

- `stream_rl.train.rows`: pack a micro-batch's samples into rows (per-sample position ids,
  block-diagonal causal attention), with flat per-completion-token tensors for the loss.
- `stream_rl.train.step_runner`: `StepRunner`: one optimizer step's micro-batches, trained and counted.
- `stream_rl.train.backends`: `build_trainer`: the run's backend (`PolicyTrainer`, DeepSpeed or FSDP2).
- `stream_rl.train.step`: `PolicyTrainer`: model, AdamW, warm-up + cosine schedule; one
  micro-batch's forward/backward, one optimizer step, the weights' checksum.
- `stream_rl.train.checkpoint`: atomic checkpoints (weights, optimizer, scheduler, RNG, counters,
  consumed offsets) and resume.
- `stream_rl.train.lineage`: reading the run's `weight-versions` log (resume, replay).
- `stream_rl.train.replay_trainer`: `stream-rl replay trainer`: re-train a run and compare checksums.
- `stream_rl.train.deepspeed_backend`: the same trainer on DeepSpeed ZeRO (GPU only).
- `stream_rl.train.fsdp_backend`: the same trainer on FSDP2 `fully_shard` (CPU/gloo or GPU).
- `stream_rl.train.ranks`: what both distributed backends share: rank 0's commands to the other
  ranks on a gloo control group, the step encoding, the statistics reduction, `shutdown`.
"""
