"""The broker's class archive: made by a broker that stopped by itself, dropped when it was killed
(tests/integration/test_broker.py runs a real one and checks the next JVM maps it)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from stream_rl.kafka.class_archive import STALE_S, ClassArchive

pytestmark = pytest.mark.unit


def test_a_clean_stop_keeps_the_dump_and_later_jvms_map_it(tmp_path: Path) -> None:
    archive = ClassArchive(tmp_path / "cds", sys.executable)
    flags, pending = archive.use_or_make()
    assert archive.use() == [] and flags[0] == f"-XX:ArchiveClassesAtExit={pending}"
    Path(pending).write_bytes(b"classes")
    archive.finish(pending, stopped_cleanly=True)
    assert archive.path.read_bytes() == b"classes" and not Path(pending).exists()
    assert archive.use_or_make() == ([f"-XX:SharedArchiveFile={archive.path}"], "")


def test_a_killed_brokers_dump_is_dropped_and_old_ones_swept(tmp_path: Path) -> None:
    archive = ClassArchive(tmp_path / "cds", sys.executable)
    _, pending = archive.use_or_make()
    Path(pending).write_bytes(b"cut")
    archive.finish(pending, stopped_cleanly=False)
    assert not Path(pending).exists() and not archive.path.exists()
    _, stale = archive.use_or_make()
    Path(stale).write_bytes(b"never finished")
    old = time.time() - STALE_S - 60
    os.utime(stale, (old, old))
    _, fresh = archive.use_or_make()
    assert not Path(stale).exists() and fresh != stale
    archive.finish("", stopped_cleanly=True)  # no dump: nothing to do


def test_another_jdk_gets_another_archive(tmp_path: Path) -> None:
    one = ClassArchive(tmp_path, sys.executable)
    other = ClassArchive(tmp_path, "/bin/sh")
    assert one.path != other.path and one.path.parent == tmp_path
