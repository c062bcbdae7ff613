"""ServerPool: least-loaded routing, the per-server cap, retries, dead servers and their return."""

from __future__ import annotations

import asyncio
import logging

import pytest
from fakes.inference import FakeServer

from stream_rl.config import SamplingConfig
from stream_rl.errors import TaskError
from stream_rl.stages.routing import RequestRejected, Server, ServerPool

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "user", "content": "2+3="}]


def pool_of(servers: list[FakeServer], **kw) -> ServerPool:  # type: ignore[no-untyped-def]
    opts = dict(cap=2, max_retries=2, backoff_s=0.001, backoff_max_s=0.01, cooldown_s=0.02)
    opts.update(kw)
    return ServerPool({s.url: s.client() for s in servers}, **opts)  # type: ignore[arg-type]


async def ask(pool: ServerPool, what: str = "r") -> str:
    async def call(server: Server) -> str:
        await server.client.complete(MESSAGES, SamplingConfig())
        return server.url

    return await pool.call(call, what)


def test_least_loaded_with_a_cap_per_server() -> None:
    async def main() -> None:
        servers = [FakeServer(f"s{i}") for i in range(3)]
        gate = asyncio.Event()
        for s in servers:
            s.gate = gate
        pool = pool_of(servers, cap=2)
        calls = [asyncio.create_task(ask(pool)) for _ in range(7)]
        while pool.in_flight() < 6:
            await asyncio.sleep(0)
        for _ in range(5):
            await asyncio.sleep(0)
        # Six fill the three servers evenly; the seventh waits for a slot.
        assert [s.in_flight for s in pool.servers] == [2, 2, 2]
        assert sum(not c.done() for c in calls) == 7
        gate.set()
        urls = await asyncio.gather(*calls)
        assert sorted(urls).count("s0") >= 2 and len(urls) == 7
        assert max(s.max_in_flight for s in servers) == 2
        await pool.aclose()

    asyncio.run(main())


def test_dead_server_leaves_routing_and_comes_back_after_a_health_probe() -> None:
    async def main() -> None:
        a, b = FakeServer("a"), FakeServer("b", down=True)
        pool = pool_of([a, b], max_retries=2)
        urls = [await ask(pool, f"r{i}") for i in range(10)]
        assert urls == ["a"] * 10  # every call succeeded, on the live server
        assert b.calls == 2  # two consecutive failures, then out of routing
        assert pool.servers[1].dead
        b.down = False
        while pool.servers[1].dead:  # probed back after the cooldown
            await asyncio.sleep(0.01)
        gate = asyncio.Event()
        a.gate = b.gate = gate
        calls = [asyncio.create_task(ask(pool)) for _ in range(4)]
        while pool.in_flight() < 4:
            await asyncio.sleep(0)
        assert [s.in_flight for s in pool.servers] == [2, 2]
        gate.set()
        assert sorted(await asyncio.gather(*calls)) == ["a", "a", "b", "b"]
        await pool.aclose()

    asyncio.run(main())


def test_all_servers_down_waits_instead_of_dropping(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        a = FakeServer("a", down=True)
        pool = pool_of([a], max_retries=1, log_every_s=0.01)
        call = asyncio.create_task(ask(pool))
        while not pool.servers[0].dead:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        assert not call.done()  # waiting, not failed
        a.down = False
        assert await asyncio.wait_for(call, 5) == "a"
        await pool.aclose()

    with caplog.at_level(logging.WARNING, logger="stream_rl.stages.routing"):
        asyncio.run(main())
    assert "no inference server in routing (a: down)" in caplog.text


def test_a_request_the_servers_keep_failing_on_is_given_up() -> None:
    async def main() -> None:
        a = FakeServer("a", crash={"2+3="})
        pool = pool_of([a], max_retries=2, cap=8)

        async def good(i: int) -> None:
            async def call(server: Server) -> None:
                await server.client.complete([{"role": "user", "content": "1+1="}], SamplingConfig())

            for _ in range(50):
                await pool.call(call, f"good{i}")
                await asyncio.sleep(0.002)

        others = asyncio.gather(*(good(i) for i in range(2)))
        with pytest.raises(RequestRejected, match="servers otherwise healthy"):
            await ask(pool, "bad")
        await others  # the good requests all succeeded meanwhile
        assert 3 <= a.failures <= 6  # max_retries + 1 strikes (a few more while the server looked dead)
        await pool.aclose()

    asyncio.run(main())


def test_a_request_the_server_refuses_is_rejected_at_once_and_the_server_stays() -> None:
    async def main() -> None:
        a = FakeServer("a", reject={"2+3="})
        pool = pool_of([a], max_retries=1)
        with pytest.raises(RequestRejected, match="refused by a: .*HTTP 400: prompt rejected"):
            await ask(pool, "bad")
        assert a.calls == 1 and not pool.servers[0].dead and pool.servers[0].failures == 0

        async def other(server: Server) -> str:
            await server.client.complete([{"role": "user", "content": "1+1="}], SamplingConfig())
            return server.url

        assert await pool.call(other, "good") == "a"  # still routed to
        await pool.aclose()

    asyncio.run(main())


def test_servers_not_holding_the_newest_version_are_set_aside_until_they_do() -> None:
    async def main() -> None:
        a, b = FakeServer("a", version=3), FakeServer("b", version=3)
        pool = pool_of([a, b], version_probe_s=0.01)
        pool.observe(3, ["a", "b"])
        pool.observe(4, ["a"], ["b"])  # b was dropped by the trainer at version 4
        assert [s.url for s in pool.live()] == ["a"]
        assert {await ask(pool, f"r{i}") for i in range(6)} == {"a"}
        b.version = 4  # the trainer re-joined it and pushed 4: the probe sees it
        for _ in range(200):
            if len(pool.live()) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(pool.live()) == 2
        pool.observe(5, [], [])  # a trainer that pushes to nobody gates nothing
        assert len(pool.live()) == 2
        await pool.aclose()

    asyncio.run(main())


def test_a_server_back_from_the_dead_is_routed_to_only_once_it_holds_the_newest_version() -> None:
    async def main() -> None:
        a = FakeServer("a", version=7, down=True)
        pool = pool_of([a], max_retries=1, version_probe_s=0.01)
        pool.observe(7, ["a"])
        call = asyncio.create_task(ask(pool))
        while not pool.servers[0].dead:
            await asyncio.sleep(0.005)
        a.down, a.version = False, 0  # restarted: it serves the weights it loaded (version 0)
        await asyncio.sleep(0.3)
        assert pool.servers[0].stale and not call.done()
        a.version = 7  # the trainer pushed the current version again
        assert await asyncio.wait_for(call, 5) == "a"
        await pool.aclose()

    asyncio.run(main())


def test_a_stale_server_that_goes_down_and_comes_back_is_probed_until_it_holds_the_version() -> None:
    """The 70-s pause of the faults issue: set aside as stale (the trainer dropped it at version
    22), then marked down while stale (its calls in flight failed), then back up holding 22. Its
    version probe had ended when it went down; it must start again, or the server stays set aside
    for good (before the fix: `_mark_stale` returned at once for a server already stale)."""

    async def main() -> None:
        a = FakeServer("a", version=21)
        pool = pool_of([a], max_retries=1, version_probe_s=0.01)
        pool.observe(21, ["a"])
        gate = asyncio.Event()
        a.gate = gate
        first = asyncio.create_task(ask(pool, "in flight"))
        while a.in_flight < 1:
            await asyncio.sleep(0.001)
        pool.observe(22, [], ["a"])  # the broadcast deadline passed: dropped at version 22
        assert pool.servers[0].stale and pool.servers[0].probing_version
        a.down = True  # the paused server's calls time out: down while stale
        gate.set()
        while not pool.servers[0].dead:
            await asyncio.sleep(0.005)
        while pool.servers[0].probing_version:  # the version probe ends while it is down
            await asyncio.sleep(0.005)
        a.gate = None
        a.down, a.version = False, 22  # SIGCONT: re-joined by the trainer, holding 22
        assert await asyncio.wait_for(first, 5) == "a"  # retried once it is back in routing
        assert pool.live() == [pool.servers[0]] and pool.servers[0].version == 22
        await pool.aclose()

    asyncio.run(main())


def test_a_busy_answer_is_retried_without_counting_against_the_server() -> None:
    async def main() -> None:
        a = FakeServer("a", busy=3)  # paused for a weight update in wait mode: 503, retry
        pool = pool_of([a], max_retries=1)
        assert await ask(pool) == "a"
        assert a.calls == 4 and pool.busy_answers == 3
        assert not pool.servers[0].dead and pool.servers[0].failures == 0
        await pool.aclose()

    asyncio.run(main())


def test_an_answer_below_the_staleness_floor_is_dropped_and_retried_elsewhere() -> None:
    async def main() -> None:
        a, b = FakeServer("a", version=10), FakeServer("b", version=10)
        pool = pool_of([a, b], max_lag=1, version_probe_s=10)
        pool.observe(10, ["a", "b"])
        seen = []

        async def call(server: Server) -> str:
            seen.append(server.url)
            pool.check_fresh(server, 0 if server.url == "a" else 10)  # a restarted unnoticed
            return server.url

        results = [await pool.call(call, f"r{i}") for i in range(4)]
        assert results == ["b"] * 4 and seen.count("a") == 1 and pool.stale_responses == 1
        assert pool.servers[0].stale and pool.servers[0].failures == 0
        pool.check_fresh(pool.servers[1], 8)  # 10 - (1 + 1): at the floor is fine
        await pool.aclose()

    asyncio.run(main())


def test_non_server_errors_are_strikes_and_give_up_after_max_retries() -> None:
    async def main() -> None:
        pool = pool_of([FakeServer("a")], max_retries=3)
        attempts = 0

        async def call(server: Server) -> None:
            nonlocal attempts
            attempts += 1
            raise TaskError("template breaks the prefix property")

        with pytest.raises(RequestRejected, match="template"):
            await pool.call(call, "r")
        assert attempts == 4 and not pool.servers[0].dead
        await pool.aclose()

    asyncio.run(main())


def test_backoff_doubles_up_to_the_cap() -> None:
    pool = pool_of([FakeServer("a")], backoff_s=0.1, backoff_max_s=0.5)
    assert [pool.backoff(i) for i in (1, 2, 3, 4)] == [0.1, 0.2, 0.4, 0.5]


def test_a_joining_server_is_routed_to_only_once_it_holds_the_newest_version() -> None:
    async def main() -> None:
        a, new = FakeServer("a", version=5), FakeServer("new", version=0)
        pool = pool_of([a], version_probe_s=0.01)
        pool.observe(5, ["a"])
        assert pool.add("new", new.client()) and not pool.add("new", new.client())
        assert [s.url for s in pool.live()] == ["a"]  # it serves version 0: set aside
        assert {await ask(pool, f"r{i}") for i in range(4)} == {"a"} and new.calls == 0
        new.version = 5  # the trainer pushed it the current version
        for _ in range(300):
            if len(pool.live()) == 2:
                break
            await asyncio.sleep(0.01)
        assert [s.url for s in pool.live()] == ["a", "new"]
        gate = asyncio.Event()
        a.gate = new.gate = gate
        calls = [asyncio.create_task(ask(pool)) for _ in range(4)]
        while pool.in_flight() < 4:
            await asyncio.sleep(0)
        gate.set()
        assert sorted(await asyncio.gather(*calls)) == ["a", "a", "new", "new"]
        await pool.aclose()

    asyncio.run(main())


def test_a_draining_server_finishes_its_calls_gets_no_new_one_and_is_forgotten() -> None:
    async def main() -> None:
        a, b = FakeServer("a"), FakeServer("b")
        gate, gate_a = asyncio.Event(), asyncio.Event()
        a.gate, b.gate = gate_a, gate
        pool = pool_of([a, b], cap=1)
        first = [asyncio.create_task(ask(pool, f"r{i}")) for i in range(2)]
        while a.in_flight < 1 or b.in_flight < 1:
            await asyncio.sleep(0)
        assert pool.drain("b") and not pool.drain("b")
        gate_a.set()
        assert pool.find("b") is not None  # its call is in flight: kept until it ends
        later = [await ask(pool, f"s{i}") for i in range(3)]
        assert later == ["a", "a", "a"] and b.calls == 1
        gate.set()
        assert sorted(await asyncio.gather(*first)) == ["a", "b"]  # the call in flight finished
        assert pool.find("b") is None and [s.url for s in pool.servers] == ["a"]
        assert not pool.drain("unknown")
        await pool.aclose()

    asyncio.run(main())
