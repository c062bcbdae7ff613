"""Does the broker's RSS grow in steps when a record larger than before passes one of its threads
(the JDK's per-thread cache of temporary direct buffers, sun.nio.ch.Util)? A throwaway broker under
Native Memory Tracking (JAVA_TOOL_OPTIONS), records of 1 KB, 100 KB, 1 MB and 4 MB produced and
consumed twice each; RSS, RssAnon and NMT's committed total and `Other` (direct buffers) printed
after each phase. Needs `jcmd` (a JDK).

    .venv/bin/python bench/broker_direct_memory.py                       # the broker as shipped
    .venv/bin/python bench/broker_direct_memory.py -Djdk.nio.maxCachedBufferSize=0   # extra JVM flags
"""

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["JAVA_TOOL_OPTIONS"] = " ".join(["-XX:NativeMemoryTracking=summary", *sys.argv[1:]])
from stream_rl.common.ports import free_port
from stream_rl.kafka.broker import LocalBroker

d = Path(tempfile.mkdtemp(prefix="broker-direct-"))
b = LocalBroker(d, port=free_port())
st = b.up(quiet=True)


def mem(tag):
    s = Path(f"/proc/{st.pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+)", s).group(1)) / 1024
    anon = int(re.search(r"RssAnon:\s+(\d+)", s).group(1)) / 1024
    nmt = subprocess.run(
        ["jcmd", str(st.pid), "VM.native_memory", "summary"], capture_output=True, text=True
    ).stdout
    other = re.search(r"-\s+Other \(reserved=\d+KB, committed=(\d+)KB", nmt)
    total = re.search(r"Total: reserved=\d+KB, committed=(\d+)KB", nmt)
    print(
        f"{tag:<34} RSS {rss:8.1f} MiB anon {anon:8.1f}  NMT committed {int(total.group(1)) / 1024 if total else -1:8.1f}  Other(direct) {int(other.group(1)) / 1024 if other else -1:6.1f}",
        flush=True,
    )


try:
    a = AdminClient({"bootstrap.servers": st.bootstrap})
    a.create_topics([NewTopic("t", 2, 1)])["t"].result()
    p = ck.Producer(
        {
            "bootstrap.servers": st.bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "message.max.bytes": 16000000,
            "compression.type": "none",
            "linger.ms": 0,
        }
    )
    c = ck.Consumer(
        {
            "bootstrap.servers": st.bootstrap,
            "group.id": "g",
            "auto.offset.reset": "earliest",
            "fetch.max.bytes": 52428800,
            "max.partition.fetch.bytes": 16000000,
        }
    )
    c.subscribe(["t"])

    def phase(size, n):
        for i in range(n):
            p.produce("t", os.urandom(size), partition=i % 2)
            p.poll(0)
        p.flush(60)
        got = 0
        deadline = time.time() + 60
        while got < n and time.time() < deadline:
            got += len([m for m in c.consume(100, 1) if not m.error()])

    time.sleep(3)
    mem("start")
    for size, n in (
        (1000, 2000),
        (1000, 2000),
        (100_000, 100),
        (100_000, 100),
        (1_000_000, 20),
        (1_000_000, 20),
        (4_000_000, 10),
        (4_000_000, 10),
    ):
        phase(size, n)
        mem(f"after {n} x {size} B")
finally:
    b.down(quiet=True)
    subprocess.run(["rm", "-rf", str(d)])
