"""The pipeline's stages: one module each, with `run(config, ...)` and a CLI entry point."""
