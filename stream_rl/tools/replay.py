"""`stream-rl replay STAGE ...`: re-run one stage on a run's retained topics (docs/running.md "How to replay").

- `replay trainer --run R`: re-train R from its `training-batches`, cut at the steps its
  `weight-versions` recorded, and compare every checksum (`stream_rl/train/replay_trainer.py`).
- `replay preprocessor --run R --into R2 [--set preprocessor.advantage=mean ...]`: re-derive
  training batches from R's `scored` with other settings into a new run R2, an offline ablation
  on the same rollouts (`stream_rl/stages/preprocessor_replay.py`).

Each stage's module provides `add_arguments(parser)` and `main(args)`; this one only dispatches on
the first argument. Neither module imports torch at its top level, so parsing stays light.
"""

from __future__ import annotations

import argparse
import importlib

# stage -> (module, help)
REPLAYS: dict[str, tuple[str, str]] = {
    "trainer": (
        "stream_rl.train.replay_trainer",
        "re-train a run from its topics and compare every checksum",
    ),
    "preprocessor": (
        "stream_rl.stages.preprocessor_replay",
        "re-derive a run's training batches with other settings into a new run (offline ablation)",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for stage, (module, help_text) in REPLAYS.items():
        p = sub.add_parser(stage, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)


def main(args: argparse.Namespace) -> int:
    module = importlib.import_module(REPLAYS[args.stage][0])
    return int(module.main(args))
