"""Kafka Admin calls that librdkafka does not offer, run on the broker's own client jars: a
single-file Java program in `deploy/kafka/` (RemoveStaticMembers, AbortHangingTransactions),
compiled once with `javac` into the jars' cache (a JRE without `javac` runs it as a single-file
source program: 2.2 s instead of 1.3 s, and 3.9 instead of 2.0 CPU-s, `bench/static_members.py`).

Only for a PLAINTEXT broker with the jars fetched (a local one): a secured cluster's Java client
settings differ from librdkafka's, so there nothing is tried and the caller says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from stream_rl.config import KafkaConfig
from stream_rl.kafka.broker import jars_dir


def program_command(java: str, jars: Path, program: Path, timeout_s: float = 60.0) -> list[str]:
    """`java` and its arguments up to the program's own: the class compiled into
    `<jars>/../programs/<source digest>/` (compiled now if it is not there yet), or the source
    file itself when there is no `javac` or it fails (its error then shows when the program runs)."""
    javac = shutil.which("javac")
    source = program.read_bytes()
    out = jars.parent / "programs" / hashlib.sha256(source + str(javac).encode()).hexdigest()[:12]
    compiled = out / f"{program.stem}.class"
    classpath = f"{jars}/*"
    if javac is not None and not compiled.exists():
        tmp = out.with_name(f"{out.name}.{uuid.uuid4().hex[:8]}.tmp")
        res = subprocess.run(
            [javac, "-nowarn", "-cp", classpath, "-d", str(tmp), str(program)],
            capture_output=True,
            timeout=timeout_s,
        )
        if res.returncode == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # another process compiled it meanwhile: theirs is the same
                tmp.rename(out)
        shutil.rmtree(tmp, ignore_errors=True)
    if compiled.exists():
        return [java, "-cp", f"{out}:{classpath}", program.stem]
    return [java, "-cp", classpath, str(program)]


@dataclass
class ProgramResult:
    ran: bool
    """False: not tried (a secured cluster, no java or jars here) or no answer in time."""
    returncode: int | None
    lines: list[str]
    """Its stdout, line by line."""
    why: str
    """Why it did not run, or its last stderr line (empty when it wrote none)."""


def run_program(
    kafka: KafkaConfig, bootstrap: str, program: Path, args: list[str], timeout_s: float = 60.0
) -> ProgramResult:
    """Run `program` with a client.properties for `bootstrap` as its first argument. Never raises."""
    if kafka.client_properties or kafka.secret_properties:
        return ProgramResult(False, None, [], "not tried on a secured cluster")
    java = shutil.which("java")
    jars = jars_dir()
    if java is None or not any(jars.glob("kafka-clients-*.jar")):
        return ProgramResult(
            False, None, [], "not tried: no java or no Kafka jars here (`stream-rl kafka fetch`)"
        )
    with tempfile.TemporaryDirectory(prefix="stream-rl-admin-") as tmp:
        props = Path(tmp) / "client.properties"
        props.write_text(
            f"bootstrap.servers={bootstrap}\nrequest.timeout.ms=15000\ndefault.api.timeout.ms=30000\n"
        )
        try:
            cmd = [*program_command(java, jars, program, timeout_s), str(props), *args]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return ProgramResult(False, None, [], f"no answer within {timeout_s:.0f} s")
    return ProgramResult(True, res.returncode, res.stdout.splitlines(), java_error(res.stderr))


def java_error(stderr: str) -> str:
    """The one line of a Java program's stderr that says what went wrong: the deepest "Caused by:"
    of an uncaught exception, else its "Exception in thread" line, else the last line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    causes = [line.removeprefix("Caused by: ") for line in lines if line.startswith("Caused by: ")]
    if causes:
        return causes[-1]
    thrown = [line.split(" ", 4)[-1] for line in lines if line.startswith("Exception in thread ")]
    if thrown:
        return thrown[0]
    return lines[-1] if lines else ""
