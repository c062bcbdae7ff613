"""The README works: paths it names exist, `make` targets and `stream-rl` commands are real."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stream_rl.cli import COMMANDS

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _tracked() -> set[str]:
    """The repository's files and their parent folders (ignored local files, e.g. runs/, don't count)."""
    import subprocess

    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    paths = set(out)
    for f in out:
        parts = f.split("/")
        paths.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return paths


TRACKED = _tracked()
README = (REPO / "README.md").read_text()
PATH_RE = re.compile(
    r"`((?:\.{0,2}/)?[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.*<>-]*)+|[A-Za-z0-9_-]+\.(?:py|yaml|yml|md|toml|json|avsc|xml|png))`"
)
GENERATED = ("runs/", ".kafka", "models/", "bench/results/", "~/", "/", "<")
# Files the project writes, named bare in the README: a run's summary, a model folder's configs,
# the wheel folder bench/gpu_wheels.sh fills.
WRITTEN = {"summary.json", "config.json", "generation_config.json", ".whl/"}


def named_paths() -> list[str]:
    out = []
    for m in PATH_RE.finditer(README):
        path = m.group(1)
        if any(path.startswith(g) for g in GENERATED) or path in WRITTEN or "<" in path or "*" in path:
            continue
        if "/" not in path and not any(t == path or t.endswith("/" + path) for t in TRACKED):
            out.append(path)  # a bare file name must exist somewhere in the repo
            continue
        if "/" in path:
            out.append(path)
    return out


def test_readme_opens_with_the_two_commands() -> None:
    head = README[: README.index("\n## ")] if "\n## " in README else README
    assert "make demo" in head and "make test" in head


@pytest.mark.parametrize("path", named_paths())
def test_named_paths_exist(path: str) -> None:
    assert (REPO / path.rstrip("/")).exists() or list(REPO.rglob(path)), (
        f"README names {path}, which does not exist"
    )


def test_make_targets_exist() -> None:
    makefile = (REPO / "Makefile").read_text()
    for target in set(re.findall(r"\bmake ([a-z][a-z-]*)", README)):
        assert re.search(rf"^{target}:", makefile, re.M), (
            f"README says `make {target}`; the Makefile has no such target"
        )


def test_cli_commands_exist() -> None:
    known = {name for name, _, _ in COMMANDS}
    for cmd in set(re.findall(r"\bstream-rl ([a-z][a-z-]*)", README)):
        assert cmd in known, f"README uses `stream-rl {cmd}`, which is not a command"
