"""Removing a stopped static member (`stream-rl scale` down, stream_rl/kafka/members.py): the
program compiled once with javac vs. launched from its source file (what a JRE without javac does).

Per repeat, both sides in turn (alternating which goes first) on one broker this script starts:
a static member joins a fresh group and closes, then the program removes it; the program's wall
time and CPU (`RUSAGE_CHILDREN`) are measured. The first repeat warms both sides up and is not
counted. Reports medians and the ratio compiled / source.

    python bench/static_members.py [--repeats 5]

Writes bench/results/static_members.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from stream_rl.common.ports import free_port
from stream_rl.kafka.broker import LocalBroker, jars_dir
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.java_admin import program_command
from stream_rl.kafka.members import PROGRAM

RESULTS = Path(__file__).parent / "results" / "static_members.json"


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _stopped_member(kafka: KafkaTransport, topic: str) -> str:
    """A group whose only member (instance "m-1") joined, got its partition and closed."""
    group = f"bench-{uuid.uuid4().hex[:8]}"
    consumer = kafka.consumer(group, "bench", instance_id="m-1")
    consumer.subscribe([topic])
    deadline = time.monotonic() + 30
    while not consumer.assignment() and time.monotonic() < deadline:
        consumer.poll_batch(10, 0.25)
    consumer.close()
    return group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    java = shutil.which("java")
    if java is None or shutil.which("javac") is None:
        raise SystemExit("needs a JDK (java and javac): apt-get install openjdk-17-jdk-headless")
    work = Path(tempfile.mkdtemp(prefix="stream-rl-bench-"))
    broker = LocalBroker(work / "kafka", port=free_port())
    state = broker.up(quiet=True)
    kafka = KafkaTransport(state.bootstrap)
    kafka.create_topics([("bench", 1, {})])
    props = work / "client.properties"
    props.write_text(f"bootstrap.servers={state.bootstrap}\nrequest.timeout.ms=15000\n")
    sides = {
        "compiled": program_command(java, jars_dir(), PROGRAM),
        "source": [java, "-cp", f"{jars_dir()}/*", str(PROGRAM)],
    }
    rows = []
    try:
        for rep in range(args.repeats + 1):
            for name in sorted(sides, reverse=rep % 2 == 1):
                group = _stopped_member(kafka, "bench")
                cpu, t0 = _children_cpu(), time.monotonic()
                res = subprocess.run([*sides[name], str(props), group, "m-1"], capture_output=True, text=True)
                wall, cpu = time.monotonic() - t0, _children_cpu() - cpu
                if not res.stdout.startswith("removed m-1"):
                    raise SystemExit(f"{name}: {res.stdout}{res.stderr}")
                if rep:
                    rows.append(
                        {"side": name, "repeat": rep, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}
                    )
                    print(f"repeat {rep} {name:<9} {wall:6.2f} s  {cpu:6.2f} CPU-s", flush=True)
    finally:
        broker.down(quiet=True)
        shutil.rmtree(work, ignore_errors=True)
    med = {
        s: {k: statistics.median(r[k] for r in rows if r["side"] == s) for k in ("wall_s", "cpu_s")}
        for s in sides
    }
    ratio = {k: round(med["compiled"][k] / med["source"][k], 3) for k in ("wall_s", "cpu_s")}
    print(f"\n{'program':<22}{'wall s (median)':>16}{'CPU-s (median)':>16}")
    for s in sides:
        print(f"{s:<22}{med[s]['wall_s']:>16.2f}{med[s]['cpu_s']:>16.2f}")
    print(f"{'ratio compiled/source':<22}{ratio['wall_s']:>16.2f}{ratio['cpu_s']:>16.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps({"repeats": args.repeats, "runs": rows, "median": med, "ratio": ratio}, indent=2) + "\n"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
