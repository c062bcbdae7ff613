"""tracemalloc in every Python process of a soak run (`bench/soak.py --trace`), nothing otherwise.

`bench/soak.py --trace` puts this directory on the launcher's PYTHONPATH (the launcher hands its
environment to every child), so each Python process imports this module at start-up. With
`STREAM_RL_SOAK_TRACE=<dir>` set it starts tracemalloc `STREAM_RL_SOAK_TRACE_DELAY` seconds after
the process starts (tracing imports of torch and transformers would take minutes),
with `STREAM_RL_SOAK_TRACE_FRAMES` frames per allocation, and dumps a snapshot every
`STREAM_RL_SOAK_TRACE_EVERY` seconds to
`<dir>/<pid>-<n>.snap`, with `<dir>/<pid>.argv` naming the process. Tracing slows a process and
costs memory per live allocation: a traced run finds what grows, its RSS figures are not the soak's.
"""

from __future__ import annotations

import os

_DIR = os.environ.get("STREAM_RL_SOAK_TRACE")


def _start(directory: str) -> None:
    import json
    import sys
    import threading
    import time
    import tracemalloc
    from pathlib import Path

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    frames = int(os.environ.get("STREAM_RL_SOAK_TRACE_FRAMES", "6"))
    delay = float(os.environ.get("STREAM_RL_SOAK_TRACE_DELAY", "30"))
    every = float(os.environ.get("STREAM_RL_SOAK_TRACE_EVERY", "60"))
    pid = os.getpid()
    cmdline = Path("/proc/self/cmdline").read_bytes().decode(errors="replace").split("\0")
    (out / f"{pid}.argv").write_text(json.dumps([a for a in cmdline if a] or sys.argv))
    started = time.monotonic()

    def dump() -> None:
        time.sleep(delay)
        tracemalloc.start(frames)
        n = 0
        while True:
            time.sleep(every)
            snap = tracemalloc.take_snapshot().filter_traces(
                (tracemalloc.Filter(False, tracemalloc.__file__),)
            )
            tmp = out / f"{pid}-{n:03d}.tmp"
            snap.dump(str(tmp))
            tmp.replace(out / f"{pid}-{n:03d}-{time.monotonic() - started:.0f}s.snap")
            n += 1

    threading.Thread(target=dump, name="soak-tracemalloc", daemon=True).start()


if _DIR:
    _start(_DIR)
