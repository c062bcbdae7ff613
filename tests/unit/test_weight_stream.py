"""`send_buckets` against `WeightReceiver.receive`: both ranks in this process (two threads).

Covers what the HTTP tests do not reach: empty tensors, destinations that are not contiguous,
a destination of the wrong shape, an error raised by `into`, and a stuck peer's deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from stream_rl.errors import WeightSyncError
from stream_rl.weights import TensorMeta, WeightReceiver, plan_buckets, weights_checksum
from stream_rl.weights.broadcast import await_work, send_buckets
from stream_rl.weights.group import SyncGroup, host_store

pytestmark = pytest.mark.unit

TIMEOUT_S = 5.0


@pytest.fixture
def pair() -> Iterator[tuple[SyncGroup, WeightReceiver]]:
    store = host_store("127.0.0.1", 0, 2, TIMEOUT_S)
    joined: list[WeightReceiver] = []
    joiner = threading.Thread(
        target=lambda: joined.append(
            WeightReceiver(
                master_addr="127.0.0.1",
                master_port=store.port,
                rank=1,
                world_size=2,
                backend="gloo",
                timeout_s=TIMEOUT_S,
            )
        )
    )
    joiner.start()
    sender = SyncGroup(
        store, rank=0, world_size=2, backend="gloo", timeout_s=TIMEOUT_S, local_addr="127.0.0.1"
    )
    joiner.join()
    yield sender, joined[0]
    joined[0].close()
    sender.close()


def tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        ("a", torch.randn(5, 3, generator=gen).to(torch.bfloat16)),
        ("empty", torch.zeros(0, 4)),
        ("b", torch.randn(7, generator=gen)),
        ("c", torch.randn(3, 2, generator=gen).half()),
        ("d", torch.randn(40, generator=gen)),  # 160 bytes: alone in 64-byte buckets
    ]


def transfer(
    sender: SyncGroup,
    receiver: WeightReceiver,
    named: list[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    into: Callable[[TensorMeta], torch.Tensor],
) -> float:
    metas = [TensorMeta.from_tensor(n, t) for n, t in named]
    result: list[float] = []
    worker = threading.Thread(target=lambda: result.append(receiver.receive(metas, bucket_bytes, into)))
    worker.start()
    send_buckets(
        sender,
        plan_buckets(metas, bucket_bytes),
        [t for _, t in named],
        deadline=time.monotonic() + TIMEOUT_S,
    )
    worker.join(TIMEOUT_S)
    assert result, "the receiver did not finish"
    return result[0]


@pytest.mark.parametrize("bucket_bytes", [1, 64, 1 << 20])
def test_transfer_into_non_contiguous_destinations_is_bit_exact(
    pair: tuple[SyncGroup, WeightReceiver], bucket_bytes: int
) -> None:
    sender, receiver = pair
    named = tensors()
    # Strided views (every other element): neither receivable in place nor copyable as raw bytes.
    storage = {n: torch.empty(*t.shape, 2, dtype=t.dtype)[..., 0] for n, t in named}
    assert not storage["d"].is_contiguous()
    calls: list[str] = []

    def into(meta: TensorMeta) -> torch.Tensor:
        calls.append(meta.name)
        return storage[meta.name]

    for _ in range(2):  # the staging buffers are reused by the second update
        calls.clear()
        assert transfer(sender, receiver, named, bucket_bytes, into) > 0
        assert calls == [n for n, _ in named]  # once each, in order
        assert weights_checksum([(n, storage[n].contiguous()) for n, _ in named]) == weights_checksum(named)
        named = [(n, t * 2) for n, t in named]


def test_wrong_destination_breaks_the_receiver(pair: tuple[SyncGroup, WeightReceiver]) -> None:
    sender, receiver = pair
    named = tensors()
    metas = [TensorMeta.from_tensor(n, t) for n, t in named]
    with pytest.raises(WeightSyncError, match=r"destination of 'a' is torch.float32\[5, 3\]"):
        receiver.receive(metas, 64, lambda m: torch.zeros(m.shape))  # float32 where bfloat16 travels
    with pytest.raises(WeightSyncError, match="broken"):
        receiver.receive(metas, 64, lambda m: torch.zeros(m.shape, dtype=m.torch_dtype))


def test_an_error_in_into_breaks_the_receiver(pair: tuple[SyncGroup, WeightReceiver]) -> None:
    _sender, receiver = pair
    metas = [TensorMeta.from_tensor(n, t) for n, t in tensors()]

    def into(meta: TensorMeta) -> torch.Tensor:
        raise KeyError(meta.name)

    with pytest.raises(KeyError):
        receiver.receive(metas, 64, into)
    with pytest.raises(WeightSyncError, match="interrupted"):
        receiver.receive(metas, 64, into)


def test_sender_gives_up_at_the_deadline_when_nobody_receives(pair: tuple[SyncGroup, WeightReceiver]) -> None:
    sender, _receiver = pair
    named = tensors()
    metas = [TensorMeta.from_tensor(n, t) for n, t in named]
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="deadline|failed"):
        send_buckets(sender, plan_buckets(metas, 64), [t for _, t in named], deadline=start + 0.5)
    assert time.monotonic() - start < 3.0


class _FailedWork:
    """A finished collective whose wait raises what gloo raised (no group needed)."""

    def __init__(self, message: str) -> None:
        self.message = message

    def done(self) -> bool:
        return True

    @property
    def work(self) -> _FailedWork:
        return self

    def wait(self) -> None:
        raise RuntimeError(self.message)


class _Group:
    timeout_s = 3.0


@pytest.mark.parametrize(
    ("gloo_says", "reason"),
    [
        (
            "[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 2992ms for send operation to complete",
            "within",
        ),
        ("[gloo/transport/tcp/pair.cc:600] Timeout waiting for recv", "within"),
        ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:11419", "broadcast failed"),
    ],
)
def test_gloos_own_timeout_is_named_as_the_deadline(gloo_says: str, reason: str) -> None:
    """gloo's timer carries the push's deadline too and can fire just before ours; either wording
    of its timeout is the deadline (a loaded CI run dropped a stalled server with "broadcast
    failed: ... Timed out waiting 2992ms", which did not say the deadline), a closed peer is not."""
    with pytest.raises(WeightSyncError) as caught:
        await_work(
            _FailedWork(gloo_says),  # type: ignore[arg-type]
            _Group(),  # type: ignore[arg-type]
            deadline=time.monotonic() + 5,
            abort=lambda: None,
            wake=threading.Event(),
        )
    assert reason in str(caught.value) and gloo_says in str(caught.value)
