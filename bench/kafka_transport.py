"""Kafka transport benchmark: rollout-shaped Avro records (~2 KB) through a real broker.

Measures serde cost (encode/decode µs per record), produce and consume throughput (records/s,
MB/s) and end-to-end latency (produce -> consume, p50/p99 at a fixed moderate rate, with the
idempotent producer's acks=all and linger.ms=5 of the stages).

    python bench/kafka_transport.py [--records 20000] [--bootstrap HOST:PORT] [--jit c1|tiered]
    python bench/kafka_transport.py --compare-jit 3 [--records 5000]

Without --bootstrap it starts a throwaway local broker, whose JIT is `--jit`: `c1` as shipped
(`stream_rl.kafka.broker.BROKER_JIT`), `tiered` the JVM's default (C1 then C2); its CPU seconds
from start to stop are reported. `--compare-jit N` runs both N times, alternating, and prints
medians and the tiered/c1 ratios (bench/results/kafka_transport_jit.json). Writes
bench/results/kafka_transport.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from stream_rl.common.ports import free_port
from stream_rl.contracts import Rollout
from stream_rl.kafka import broker as broker_module
from stream_rl.kafka.broker import LocalBroker
from stream_rl.kafka.confluent import KafkaTransport
from stream_rl.kafka.serde import default_serde

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test builders (tests/fakes)

from fakes.records import make_rollout  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "kafka_transport.json"


def bench_serde(records: list[Rollout]) -> dict[str, float]:
    serde = default_serde()
    t0 = time.perf_counter()
    blobs = [serde.encode(r) for r in records]
    t1 = time.perf_counter()
    for b in blobs:
        serde.decode(b, Rollout)
    t2 = time.perf_counter()
    n = len(records)
    return {
        "record_bytes_mean": statistics.mean(len(b) for b in blobs),
        "encode_us": (t1 - t0) / n * 1e6,
        "decode_us": (t2 - t1) / n * 1e6,
    }


def bench_throughput(kafka: KafkaTransport, topic: str, blobs: list[bytes]) -> dict[str, float]:
    p = kafka.producer("bench-producer")
    t0 = time.perf_counter()
    for i, b in enumerate(blobs):
        p.produce(topic, b, key=f"group-{i % 512}")
    p.flush(120)
    t1 = time.perf_counter()
    c = kafka.consumer(None, "bench-consumer")
    c.assign({(topic, part): 0 for part in kafka.partitions(topic)})
    got = 0
    t2 = time.perf_counter()
    while got < len(blobs):
        got += len(c.poll_batch(10000, 1.0))
    t3 = time.perf_counter()
    c.close()
    total_mb = sum(len(b) for b in blobs) / 1e6
    return {
        "produce_records_per_s": len(blobs) / (t1 - t0),
        "produce_mb_per_s": total_mb / (t1 - t0),
        "consume_records_per_s": len(blobs) / (t3 - t2),
        "consume_mb_per_s": total_mb / (t3 - t2),
    }


def bench_latency(kafka: KafkaTransport, topic: str, blob: bytes, n: int, rate: float) -> dict[str, float]:
    c = kafka.consumer(None, "bench-latency")
    c.assign({(topic, part): 0 for part in kafka.partitions(topic)})
    c.poll_batch(1, 1.0)  # connect before timing
    latencies: list[float] = []
    done = threading.Event()

    def consume() -> None:
        while len(latencies) < n:
            for m in c.poll_batch(100, 0.1):
                latencies.append(time.time() - float(m.header("sent") or b"0"))
        done.set()

    th = threading.Thread(target=consume, daemon=True)
    th.start()
    p = kafka.producer("bench-latency-producer")
    for i in range(n):
        p.produce(topic, blob, key=f"k{i}", headers={"sent": repr(time.time())})
        time.sleep(1.0 / rate)
    p.flush()
    done.wait(60)
    c.close()
    ms = sorted(x * 1000 for x in latencies)
    return {
        "latency_p50_ms": ms[len(ms) // 2],
        "latency_p99_ms": ms[int(len(ms) * 0.99) - 1],
        "latency_records": len(ms),
        "latency_rate_per_s": rate,
    }


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(args: argparse.Namespace, jit: str) -> dict[str, float | None]:
    broker = None
    broker_start_s = broker_cpu_s = None
    if args.bootstrap is None:
        broker_module.BROKER_JIT = list(JITS[jit])
        broker = LocalBroker(tempfile.mkdtemp(prefix="bench-kafka-"), port=free_port())
        t0 = time.perf_counter()
        bootstrap = broker.up(quiet=True).bootstrap
        broker_start_s = time.perf_counter() - t0
    else:
        bootstrap = args.bootstrap
    try:
        kafka = KafkaTransport(bootstrap)
        run = uuid.uuid4().hex[:8]
        topic, lat_topic = f"bench.{run}.rollouts", f"bench.{run}.latency"
        kafka.create_topics([(topic, 4, {}), (lat_topic, 1, {})])
        records = [make_rollout(i, i % 8, 8, completion_len=256, prompt_len=96) for i in range(args.records)]
        serde = bench_serde(records[: min(len(records), 5000)])
        blobs = [default_serde().encode(r) for r in records]
        thr = bench_throughput(kafka, topic, blobs)
        lat = bench_latency(kafka, lat_topic, blobs[0], args.latency_records, args.latency_rate)
        if broker is not None:
            st = broker.running()
            broker_cpu_s = cpu_s(st.pid) if st is not None else None
    finally:
        if broker is not None:
            broker.down(quiet=True)
    return {**serde, **thr, **lat, "broker_start_s": broker_start_s, "broker_cpu_s": broker_cpu_s}


JITS = {"c1": tuple(broker_module.BROKER_JIT), "tiered": ()}


def compare_jit(args: argparse.Namespace) -> None:
    keys = (
        "broker_cpu_s",
        "broker_start_s",
        "produce_records_per_s",
        "consume_records_per_s",
        "latency_p50_ms",
        "latency_p99_ms",
    )
    runs: dict[str, list[dict[str, float | None]]] = {"c1": [], "tiered": []}
    for i in range(args.compare_jit):
        for jit in ("c1", "tiered") if i % 2 == 0 else ("tiered", "c1"):
            runs[jit].append(measure(args, jit))
            print(
                f"  repeat {i + 1}/{args.compare_jit} {jit}: broker CPU {runs[jit][-1]['broker_cpu_s']:.1f} s",
                flush=True,
            )
    med = {
        jit: {k: statistics.median(float(r[k] or 0.0) for r in rs) for k in keys} for jit, rs in runs.items()
    }
    print(
        f"\nLocal broker JIT, {args.records} records + {args.latency_records} latency probes, "
        f"median of {args.compare_jit} (alternating)\n"
    )
    print(f"  {'figure':<24} {'c1 (shipped)':>14} {'tiered':>14} {'tiered / c1':>12}")
    for k in keys:
        c1, tiered = med["c1"][k], med["tiered"][k]
        print(f"  {k:<24} {c1:>14.2f} {tiered:>14.2f} {tiered / c1 if c1 else float('nan'):>12.2f}")
    out = RESULTS.with_name("kafka_transport_jit.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"records": args.records, "repeats": args.compare_jit, "runs": runs, "median": med}, indent=2
        )
    )
    print(f"\nwrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--latency-records", type=int, default=2000)
    ap.add_argument("--latency-rate", type=float, default=500.0)
    ap.add_argument("--bootstrap", default=None)
    ap.add_argument("--jit", choices=sorted(JITS), default="c1", help="the throwaway broker's JIT")
    ap.add_argument(
        "--compare-jit", type=int, default=0, metavar="N", help="c1 against tiered, N repeats each"
    )
    args = ap.parse_args()
    if args.bootstrap is not None and (args.compare_jit or args.jit != "c1"):
        ap.error("--jit and --compare-jit choose the throwaway broker's JIT: not with --bootstrap")
    if args.compare_jit:
        compare_jit(args)
        return
    m = measure(args, args.jit)
    serde = thr = lat = m
    broker_start_s = m["broker_start_s"]

    result = {"records": args.records, "jit": args.jit, **m}
    rows = [
        ("record size (Avro single object)", f"{serde['record_bytes_mean']:.0f} B"),
        ("encode", f"{serde['encode_us']:.1f} µs/record"),
        ("decode (+validate)", f"{serde['decode_us']:.1f} µs/record"),
        (
            "produce (idempotent, acks=all)",
            f"{thr['produce_records_per_s']:,.0f} rec/s  {thr['produce_mb_per_s']:.1f} MB/s",
        ),
        (
            "consume (read_committed)",
            f"{thr['consume_records_per_s']:,.0f} rec/s  {thr['consume_mb_per_s']:.1f} MB/s",
        ),
        (
            f"end-to-end latency @ {args.latency_rate:.0f} rec/s",
            f"p50 {lat['latency_p50_ms']:.1f} ms  p99 {lat['latency_p99_ms']:.1f} ms",
        ),
    ]
    if broker_start_s is not None:
        rows.append(("local broker start (format + start + ready)", f"{broker_start_s:.1f} s"))
    width = max(len(r[0]) for r in rows)
    print(f"\nKafka transport, {args.records} rollout records\n")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
