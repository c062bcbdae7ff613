"""The pipeline's stages, one module each: loader, actor, verifier, preprocessor (trainer elsewhere).

Every stage module opens with what it consumes and produces, its invariants and how to run it
alone; declares `CONSUMES` / `PRODUCES` with topology names (a test checks them against
`topology/topics.yaml`); and exposes `run(config, *, transport=None, stop=None, max_records=None,
idle_timeout_s=None, instance=0) -> StageStats` plus the CLI hooks `add_arguments` / `main`.
"""
