"""The `stream-rl` command. Each subcommand lives in the module that does the work and exposes
`add_arguments(parser)` and `main(args) -> int`; modules are imported lazily, so `stream-rl
kafka up` does not import torch. Errors a user can act on print one line and exit 2.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import logging
import os
import signal
import sys

from stream_rl.errors import StreamRLError

# (name, module, help). Modules provide add_arguments(parser) and main(args).
COMMANDS: list[tuple[str, str, str]] = [
    ("kafka", "stream_rl.kafka.commands", "local Kafka: fetch, up, down, status, compose-secrets, users"),
    ("topics", "stream_rl.kafka.commands", "create (apply) or list a run's topics"),
    ("lag", "stream_rl.kafka.commands", "consumer lag of a run's groups"),
    (
        "hanging",
        "stream_rl.kafka.commands",
        "hanging transactions on a run's topics (KIP-664): list them, or --abort them",
    ),
    ("acls", "stream_rl.kafka.acl_admin", "the ACLs of a run's principals: plan (print) or apply"),
    ("loader", "stream_rl.stages.loader", "write the task's problems to `problems` (idempotent)"),
    ("actor", "stream_rl.stages.actor", "sample groups of rollouts from the inference servers"),
    ("verifier", "stream_rl.stages.verifier", "score rollouts with the task's reward function"),
    ("preprocessor", "stream_rl.stages.preprocessor", "complete groups -> advantages -> micro-batches"),
    ("evaluator", "stream_rl.stages.evaluator", "evaluate weight versions on the task's held-out split"),
    ("make-model", "stream_rl.tools.warm_start", "write a tiny random model + tokenizer (HF directory)"),
    ("serve", "stream_rl.inference.server", "run the built-in inference server (OpenAI API + weight sync)"),
    (
        "servers",
        "stream_rl.run.servers",
        "inference servers joining or leaving a running run: join, leave, list",
    ),
    (
        "scale",
        "stream_rl.run.scaling",
        "change a launcher-managed run's actors, verifiers, preprocessors, servers",
    ),
    ("run", "stream_rl.run.launch", "launch a whole run from a config: broker, topics, servers, stages"),
    ("report", "stream_rl.observe.report", "re-derive a finished run's summary.json and plots"),
    ("runs", "stream_rl.observe.runs", "list the runs in runs/: state, versions, reward, eval, where"),
    ("status", "stream_rl.observe.status", "live table of a run: processes, servers, lag, trainer version"),
    ("trainer", "stream_rl.stages.trainer", "train on training-batches, broadcast weights, publish versions"),
    (
        "export",
        "stream_rl.tools.export",
        "a run's weights (HF directory, checksum checked) or rollouts (Parquet)",
    ),
    ("track", "stream_rl.tools.track", "log a run's metrics, evals and config to W&B, MLflow or TensorBoard"),
    (
        "rescore",
        "stream_rl.tools.rescore",
        "re-score a run's rollouts with the current verifier into a new run",
    ),
    (
        "replay",
        "stream_rl.tools.replay",
        "re-run a stage on a run's topics: trainer (checksums), preprocessor (ablation)",
    ),
]


def add_common(parser: argparse.ArgumentParser, config: bool = True) -> None:
    """`--config`, `--set` and `--bootstrap`: the options every command that reads a run shares."""
    if config:
        parser.add_argument("--config", "-c", help="run config YAML (defaults when omitted)")
        parser.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config value, e.g. --set trainer.lr=1e-5 (repeatable)",
        )
    parser.add_argument(
        "--bootstrap",
        default=None,
        help="Kafka bootstrap servers (default: config, then $STREAM_RL_KAFKA_BOOTSTRAP)",
    )


def _top_parser() -> argparse.ArgumentParser:
    epilog = "commands:\n" + "\n".join(f"  {name:<14} {help_text}" for name, _, help_text in COMMANDS)
    epilog += "\n\nRun `stream-rl COMMAND --help` for a command's options."
    parser = argparse.ArgumentParser(
        prog="stream-rl",
        description=__doc__.split("\n")[0],
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default=os.environ.get("STREAM_RL_LOG_LEVEL", "INFO"))
    parser.add_argument("command", choices=[c[0] for c in COMMANDS], metavar="COMMAND")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def command_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
    """The parser of one subcommand (importing only its module) and the module."""
    module, help_text = next((m, h) for n, m, h in COMMANDS if n == name)
    mod = importlib.import_module(module)
    parser = argparse.ArgumentParser(prog=f"stream-rl {name}", description=help_text)
    adder = getattr(mod, f"add_{name.replace('-', '_')}_arguments", None) or mod.add_arguments
    adder(parser)
    return parser, mod


STACKS_SIGNAL = signal.SIGUSR1
"""Every `stream-rl` command prints all its threads' Python stacks to stderr on this signal
(`faulthandler`) and goes on: the launcher sends it to a stage before killing it as stuck."""


def main(argv: list[str] | None = None) -> int:
    top = _top_parser().parse_args(sys.argv[1:] if argv is None else argv)
    # To file descriptor 2 (a stage's log), not sys.stderr, which a caller of main() may replace.
    faulthandler.register(STACKS_SIGNAL, file=2, all_threads=True, chain=False)
    logging.basicConfig(
        level=top.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One INFO line per HTTP request would dominate the actor's log (and its CPU).
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    parser, mod = command_parser(top.command)
    args = parser.parse_args(top.rest)
    runner = getattr(mod, f"main_{top.command.replace('-', '_')}", None) or mod.main  # type: ignore[attr-defined]
    try:
        return int(runner(args) or 0)
    except StreamRLError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
