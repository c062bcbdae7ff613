"""How the Admin programs (stream_rl/kafka/java_admin.py: RemoveStaticMembers for `stream-rl
scale`, AbortHangingTransactions for the launcher) run: the class compiled once into the jars'
cache where there is a javac, the source file where there is none or it fails."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stream_rl.kafka import java_admin, members

pytestmark = pytest.mark.unit


def _fake_javac(tmp_path: Path, body: str) -> str:
    javac = tmp_path / "bin" / "javac"
    javac.parent.mkdir(exist_ok=True)
    javac.write_text(f"#!/bin/sh\n{body}\n")
    javac.chmod(0o755)
    return str(javac)


def test_compiled_once_then_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jars = tmp_path / "kafka" / "lib"
    calls = tmp_path / "calls"
    # A javac that writes the class into its -d directory (argument 5) and counts its calls.
    javac = _fake_javac(tmp_path, f'echo x >> {calls}; mkdir -p "$5" && touch "$5/RemoveStaticMembers.class"')
    monkeypatch.setattr(shutil, "which", lambda name: javac if name == "javac" else None)
    first = java_admin.program_command("java", jars, members.PROGRAM)
    assert first[:2] == ["java", "-cp"] and first[-1] == "RemoveStaticMembers"
    out = Path(first[2].split(":")[0])
    assert out.parent == tmp_path / "kafka" / "programs" and (out / "RemoveStaticMembers.class").exists()
    assert first[2].endswith(f":{jars}/*")
    assert java_admin.program_command("java", jars, members.PROGRAM) == first
    assert calls.read_text().count("x") == 1
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary directory left


@pytest.mark.parametrize("javac", ["none", "failing"])
def test_without_a_working_javac_the_source_file_runs(
    javac: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = None if javac == "none" else _fake_javac(tmp_path, "echo 'error: cannot find symbol' >&2; exit 1")
    monkeypatch.setattr(shutil, "which", lambda name: path if name == "javac" else None)
    jars = tmp_path / "kafka" / "lib"
    assert java_admin.program_command("java", jars, members.PROGRAM) == [
        "java",
        "-cp",
        f"{jars}/*",
        str(members.PROGRAM),
    ]
    assert not any((tmp_path / "kafka" / "programs").glob("*"))


def test_a_java_exception_is_told_by_its_deepest_cause() -> None:
    stderr = """Exception in thread "main" java.util.concurrent.ExecutionException: org.apache.kafka.common.errors.TimeoutException: timed out
\tat java.base/java.util.concurrent.CompletableFuture.reportGet(CompletableFuture.java:396)
\tat AbortHangingTransactions.main(AbortHangingTransactions.java:60)
Caused by: org.apache.kafka.common.errors.TimeoutException: Timed out waiting for a node assignment. Call: describeProducers
"""
    assert java_admin.java_error(stderr) == (
        "org.apache.kafka.common.errors.TimeoutException: Timed out waiting for a node assignment. Call: describeProducers"
    )
    assert java_admin.java_error(stderr.split("\n")[0]) == (
        "java.util.concurrent.ExecutionException: org.apache.kafka.common.errors.TimeoutException: timed out"
    )
    assert java_admin.java_error("error: file not found\n") == "error: file not found"
    assert java_admin.java_error("") == ""
