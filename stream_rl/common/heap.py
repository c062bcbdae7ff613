"""Keeping a long-lived process's memory flat: `settle()` once start-up is done.

- Collect, then `gc.freeze()` everything alive (the modules, the model, the tokenizer). CPython
  runs a full collection only once the objects surviving into the oldest generation grow by a
  quarter of those already there; with torch and transformers imported that is hundreds of
  thousands of objects, so the cyclic garbage of a served run (asyncio transports and protocols
  of closed HTTP connections) piled up for many minutes between full collections: a soak's trace
  of the inference server found them growing its Python heap. Frozen objects are left out of
  that count and of every collection: full collections come when the run's own garbage warrants
  them, and each is cheaper. (Traced again with this, the server's Python heap: +0.03 MiB/min.)
- Then, every `TRIM_EVERY_S`, `malloc_trim(0)`: glibc's hand-back of freed heap pages to the
  system. Large allocations (Kafka record values, HTTP bodies, tensors) come from glibc's
  per-thread arenas, and the stages allocate from several threads (librdkafka callbacks, asyncio's
  thread pool, the weight receiver): a soak found every Python process's RSS creeping (0.3 to 4
  MiB/min) while its traced Python heap stayed flat, i.e. freed memory the arenas kept. `trim()`
  is also called after a checkpoint, the trainer's largest burst. A no-op where the C library has
  no `malloc_trim`.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import threading
import time

TRIM_EVERY_S = 60.0
_trimmer: threading.Thread | None = None


def settle() -> None:
    """Collect, keep everything alive now out of later collections, and start trimming the C heap
    every `TRIM_EVERY_S` (once per process; see the module docstring). Call when start-up is done.
    A later call (a process that runs several stages in turn: the tests) keeps what earlier calls
    froze and freezes what came since. Thawing first would make every call a collection of the
    whole process (~0.3 s of CPU with torch imported, per stage run: a third of the unit tier's
    CPU); what it leaves frozen for good is the cyclic garbage of the stages before, which is small
    (the unit tier in one process: ~4,000 objects after 77 stage runs). `release()` thaws it all."""
    global _trimmer
    gc.collect()
    gc.freeze()
    trim()
    if _trimmer is None and _malloc_trim() is not None:
        _trimmer = threading.Thread(target=_trim_forever, name="heap-trim", daemon=True)
        _trimmer.start()


def _trim_forever() -> None:
    while True:
        time.sleep(TRIM_EVERY_S)
        trim()


def release() -> None:
    """Thaw what `settle` froze and collect it all: at shutdown, before something that needs the
    run's dropped objects gone (the launcher's Kafka clients before their broker stops)."""
    gc.unfreeze()
    gc.collect()


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:  # the process's own symbols: the C library it runs on, without a search for it
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def trim() -> None:
    """Give freed heap pages back to the system (glibc); nothing elsewhere."""
    fn = _malloc_trim()
    if fn is not None:
        fn(0)
