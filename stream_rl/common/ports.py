"""Ports for a process to listen on: one free now and not handed out before (`free_port`), and
whether one is free or frees within a moment.
"""

from __future__ import annotations

import collections
import random
import socket
import threading
import time
from pathlib import Path


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_frees(port: int, host: str, within_s: float = 5.0) -> bool:
    """Whether `port` is free now or within `within_s`: a killed JVM counts as gone (its main
    thread a zombie) while its other threads still hold its sockets, ~0.1 s (a restart right after
    a kill -9 found the port taken)."""
    deadline = time.monotonic() + within_s
    while not port_is_free(port, host):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_PORTS_FROM = 10000


def listen_range() -> tuple[int, int] | None:
    """Ports below the kernel's ephemeral range (Linux: 32768-60999 by default), None if unknown."""
    try:
        low = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (LISTEN_PORTS_FROM, low - 1) if low - 1 > LISTEN_PORTS_FROM + 1000 else None


_GIVEN: collections.deque[int] = collections.deque(maxlen=4096)
"""The ports `free_port` handed out in this process, latest last: never handed out again while
here. A port is free until its taker binds it, and a launcher asks for its stages' ports in one go
before any of them starts: two at random from ~23k ports met in a clean-clone run (actor-0 and
actor-1 both given 13497; the second died on `Address already in use`)."""
_GIVEN_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a process (this one or a child) to listen on a moment later, and not
    one this process handed out before (`_GIVEN`). Taken at random below the kernel's ephemeral
    range where there is one: a port the kernel hands out (bind to 0) can be taken meanwhile as the
    local port of any outgoing connection, and a run's or the test suite's Kafka clients open those
    all the time (seen: a server's `cannot bind`)."""
    with _GIVEN_LOCK:
        port = _free_port(host, set(_GIVEN))
        _GIVEN.append(port)
        return port


def _free_port(host: str, given: set[int]) -> int:
    span = listen_range()
    if span is not None:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randint(*span)
            if port in given:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in given:
            return port
    raise OSError(f"no free port on {host} that this process has not handed out already")
