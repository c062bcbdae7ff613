"""The pipeline's stages, one module each: loader, actor, verifier, preprocessor, trainer.

Every stage module opens with what it consumes and produces, its invariants and how to run it
alone; declares `CONSUMES` / `PRODUCES` with topology names (a test checks them against
`topology/topics.yaml`); and exposes `run(config, *, transport=None, stop=None, max_records=None,
idle_timeout_s=None, instance=0) -> StageStats` plus the CLI hooks `add_arguments` / `main`.
The trainer is the exception in shape: it is bounded by optimizer steps, not records
(`run(config, transport=None, *, pusher=None, stop=None, max_steps=None, idle_timeout_s=None)
-> TrainerStats`), and commits after checkpoints rather than per batch.
"""
