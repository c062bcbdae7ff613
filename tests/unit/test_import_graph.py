"""The import graph of `stream_rl`: no circle, and no arrow back up.

Every import counts, the lazy ones inside functions too (a lazy import hides a circle from the
interpreter, not from a reader); imports under `if TYPE_CHECKING:` do not. Three layers:

- the foundations every layer may use: `config`, `errors`, `common` (model loading, metrics,
  windows, heap) and `cli`'s shared options;
- the parts: `contracts`, `kafka`, `inference`, `weights`, `train`, `rl`, `tasks`, `stages`;
- what composes them: `run` (the launcher and what it runs), `observe` (status, runs, report,
  plots), `tools` (export, track, rescore, replay, make-model).

An arrow back up is a part (or a foundation) importing a composer, or a foundation importing a
part: the composers compose the parts, not the other way round.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "stream_rl"
FOUNDATIONS = ("stream_rl.config", "stream_rl.errors", "stream_rl.common", "stream_rl.cli")
COMPOSERS = ("stream_rl.run", "stream_rl.observe", "stream_rl.tools")


def layer(module: str) -> int:
    """0: a foundation, 1: a part, 2: a composer (the package itself: 2, it is the entry)."""
    if module == "stream_rl":
        return 2
    if any(module == f or module.startswith(f + ".") for f in FOUNDATIONS):
        return 0
    if any(module == c or module.startswith(c + ".") for c in COMPOSERS):
        return 2
    return 1


def module_files() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+(stream_rl[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]+)|import[ \t]+(stream_rl[\w.]*))",
    re.MULTILINE,
)
TYPE_ONLY = re.compile(r"^([ \t]*)if (?:typing\.)?TYPE_CHECKING:\n(?:\1[ \t]+.*\n|[ \t]*\n)*", re.MULTILINE)


def imported_names(source: str) -> list[str]:
    """The stream_rl names `source` imports (`from a.b import c` gives `a.b` and `a.b.c`), read
    with a regular expression (parsing every module with `ast` costs a second here)."""
    names: list[str] = []
    for module, what, plain in IMPORT.findall(TYPE_ONLY.sub("", source)):
        if plain:
            names.append(plain)
            continue
        names.append(module)
        names.extend(
            f"{module}.{n.split()[0]}" for n in what.strip("()").replace("\n", " ").split(",") if n.strip()
        )
    return names


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the stream_rl modules it imports (a package's own submodules and its parents aside)."""
    files = module_files()

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        targets = {resolve(n) for n in imported_names(path.read_text())}
        graph[mod] = {
            t
            for t in targets
            if t is not None and t != mod and not mod.startswith(t + ".") and not t.startswith(mod + ".")
        }
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_lazy_and_parenthesised_imports_not_type_only_ones() -> None:
    source = (
        "from stream_rl.a import (\n    b,\n    c as d,\n)\nif TYPE_CHECKING:\n    import stream_rl.e\n\n"
        "def f():\n    from stream_rl import g  # why\n"
    )
    assert imported_names(source) == [
        "stream_rl.a",
        "stream_rl.a.b",
        "stream_rl.a.c",
        "stream_rl",
        "stream_rl.g",
    ]
    graph = import_graph()
    assert "stream_rl.train.deepspeed_backend" in graph["stream_rl.train.backends"]  # imported in a function
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_among_stream_rl_modules() -> None:
    assert circles(import_graph()) == []


def test_no_arrow_back_up_from_a_lower_layer() -> None:
    back_up = sorted(
        f"{mod} -> {t}"
        for mod, targets in import_graph().items()
        if mod != "stream_rl.cli"  # the entry point: it names every command's module
        for t in targets
        if layer(t) > layer(mod)
    )
    assert back_up == []


def test_the_only_modules_directly_under_the_package_are_its_entry_points() -> None:
    """`cli` (the command), `errors` (the exceptions a user's code catches); the rest lives in the
    subpackage of its job."""
    top = sorted(m for m, p in module_files().items() if m.count(".") == 1 and p.name != "__init__.py")
    assert top == ["stream_rl.cli", "stream_rl.errors"]


def test_no_trainer_backend_imports_another() -> None:
    """`stream_rl.train.backends`' rule: each backend depends on `step` (the distributed ones also
    on `ranks`), never on another backend; what two share lives in a module of its own."""
    backends = {"stream_rl.train.deepspeed_backend", "stream_rl.train.fsdp_backend"}
    graph = import_graph()
    assert sorted(f"{b} -> {t}" for b in backends for t in graph[b] & backends) == []
    assert all("stream_rl.train.ranks" in graph[b] for b in backends)
