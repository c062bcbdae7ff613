"""The local broker's class-data-sharing archive (JDK AppCDS): the Kafka classes a broker loads,
parsed and verified once and mapped by every later JVM on the same jars and JDK.

The first broker started without an archive runs with `-XX:ArchiveClassesAtExit` into a file of
its own; when it stops by itself (SIGTERM, not SIGKILL) that file becomes the archive, under
`~/.cache/stream-rl/kafka-<version>/cds/`, named after the JDK it was made by. Later brokers and
the storage formatter start with `-XX:SharedArchiveFile` (measured on 2 cores: a broker's CPU to
ready 3.2 -> 2.0 s, ready 3.6 -> 2.4 s). The JVM checks the archive against its own build and
class path and ignores one that does not match (a warning in broker.log), so a wrong archive
costs nothing but the saving.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import uuid
from pathlib import Path

STALE_S = 24 * 3600.0
"""A dump file this old belongs to a broker that was killed and never stopped (a live one's is
written only at its exit)."""


class ClassArchive:
    """The archive in `directory` for the JDK at `java` (a path)."""

    def __init__(self, directory: Path, java: str) -> None:
        real = Path(java).resolve()
        try:
            st = real.stat()
            ident = f"{real}:{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            ident = str(real)
        self.directory = directory
        self.path = directory / f"jdk-{hashlib.sha1(ident.encode()).hexdigest()[:12]}.jsa"

    def use(self) -> list[str]:
        """The flags that map the archive, or none while there is none."""
        return [f"-XX:SharedArchiveFile={self.path}"] if self.path.exists() else []

    def use_or_make(self) -> tuple[list[str], str]:
        """A broker's flags and the file it dumps into at exit ("" when the archive exists): pass
        that name to `finish` once the broker has stopped."""
        if self.path.exists():
            return self.use(), ""
        self.directory.mkdir(parents=True, exist_ok=True)
        for old in self.directory.glob("*.tmp"):  # a killed broker's, older than any live one's
            with contextlib.suppress(OSError):
                if time.time() - old.stat().st_mtime > STALE_S:
                    old.unlink()
        pending = str(self.path.with_name(f"{self.path.stem}.{uuid.uuid4().hex[:8]}.tmp"))
        # The dump lists every class it skips (JFR events, unlinked classes) as a warning: noise.
        return [f"-XX:ArchiveClassesAtExit={pending}", "-Xlog:cds*=error"], pending

    def finish(self, pending: str, stopped_cleanly: bool) -> None:
        """Keep what a broker that stopped by itself dumped; drop a killed one's (it may be cut)."""
        if not pending:
            return
        tmp = Path(pending)
        if stopped_cleanly and tmp.exists() and tmp.stat().st_size > 0:
            os.replace(tmp, self.path)
        else:
            with contextlib.suppress(OSError):
                tmp.unlink()
