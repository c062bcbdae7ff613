"""The README and the docs work: paths they name exist, `make` targets and `stream-rl` commands
are real; the README stays a front door (the docs site's strict build checks their links)."""

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
# The README and every page of the docs site (docs/index.md is the README, see docs/hooks.py).
DOCS = {"README.md": README} | {
    f"docs/{p.name}": p.read_text() for p in sorted((REPO / "docs").glob("*.md")) if p.name != "index.md"
}
TEXT = "\n".join(DOCS.values())
PATH_RE = re.compile(
    r"`((?:\.{0,2}/)?[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.*<>-]*)+|[A-Za-z0-9_-]+\.(?:py|yaml|yml|md|toml|json|avsc|xml|png))`"
)
GENERATED = (
    "runs/",
    ".kafka",
    "models/",
    "bench/results/",
    "site/",
    ".venv",  # make setup and make vllm link .venv and .venv-vllm to the cached environments
    "deploy/compose/.secrets",
    "~/",
    "/",
    "<",
)
# Files the project writes, named bare in the docs: a run's summary and overview plot, a model folder's
# configs, a LoRA checkpoint's model/ folder and peft's adapter config, the wheel folder
# bench/gpu_wheels.sh fills, and what `stream-rl kafka compose-secrets` writes (its CA folder, the
# operator's config and the host tools' config).
WRITTEN = {
    "pki/",
    "operator.yaml",
    "host.yaml",
    "summary.json",
    "config.json",
    "generation_config.json",
    ".whl/",
    "overview.png",
    "model/",
    "adapter_config.json",
}


def named_paths() -> list[str]:
    out = []
    for m in PATH_RE.finditer(TEXT):
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
        f"the docs name {path}, which does not exist"
    )


def test_make_targets_exist() -> None:
    makefile = (REPO / "Makefile").read_text()
    for target in set(re.findall(r"(?:^|[`$] ?)make ([a-z][a-z-]*)", TEXT, re.M)):
        assert re.search(rf"^{target}:", makefile, re.M), (
            f"the docs say `make {target}`; the Makefile has no such target"
        )


def test_cli_commands_exist() -> None:
    known = {name for name, _, _ in COMMANDS}
    for name, text in DOCS.items():
        for cmd in set(re.findall(r"\bstream-rl ([a-z][a-z-]*)", text)):
            assert cmd in known, f"{name} uses `stream-rl {cmd}`, which is not a command"


def test_readme_is_a_front_door() -> None:
    """What it is, the picture, the two commands, the table of contents: at most 250 lines; the
    rest lives in docs/, each page in the site's nav."""
    assert len(README.splitlines()) <= 250
    nav = (REPO / "mkdocs.yml").read_text()
    for name in DOCS:
        if name.startswith("docs/"):
            assert name.removeprefix("docs/") in nav, f"{name} is not in mkdocs.yml's nav"
            assert f"({name})" in README or f"({name}#" in README, f"the README does not link {name}"
