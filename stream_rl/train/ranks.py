"""The protocol between the ranks of a distributed trainer (`trainer.backend: deepspeed` or
`fsdp2`), shared by both backends so that neither depends on the other.

Rank 0 runs the trainer stage and drives; every rank > 0 (`is_follower()`) runs its backend's
`follow()`, executing the same collective operations in the same order. Rank 0 announces each
operation on a gloo group of all ranks (`Control`; the backend's own traffic, NCCL or gloo, goes
elsewhere) as a command: a broadcast int64 header `[op, payload length]`, then, when the length
is not 0, the payload as a broadcast uint8 tensor. The ops:
- `OP_STEP`: one optimizer step; the payload is `encode_step(batches, sequences)`: the step's
  micro-batches, Avro single-object encoded as on Kafka (nothing pickled), and the number of
  trained sequences. Every rank trains its share and the token statistics are combined with
  `reduce_stats` (sums, `ratio_max` by max) on the same group.
- `OP_WEIGHTS`: every rank takes part in gathering the full weights; rank 0 checksums/pushes them.
- `OP_SAVE` / `OP_LOAD`: the payload is a checkpoint directory, UTF-8 (collective save / load).
- `OP_STOP`: the followers leave `follow()`.
What each op does on a rank is the backend's (see its module doc); the encoding is this module's.
Every process ends with `shutdown()`.
"""

from __future__ import annotations

import struct
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from stream_rl.contracts import TrainingBatch
from stream_rl.kafka.serde import default_serde
from stream_rl.rl.stats import TokenStats

if TYPE_CHECKING:
    from contextlib import AbstractContextManager
    from pathlib import Path

    from stream_rl.config import TrainerConfig
    from stream_rl.contracts import TrainingSample
    from stream_rl.train.step import MicroResult, StepOutcome

OP_STEP, OP_WEIGHTS, OP_SAVE, OP_LOAD, OP_STOP = 1, 2, 3, 4, 5


class Control:
    """Rank 0's commands to the other ranks over a gloo group (created collectively: every rank
    constructs one, in the same order)."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")
        self.rank = dist.get_rank()

    def send(self, op: int, payload: bytes = b"") -> None:
        header = torch.tensor([op, len(payload)], dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0, group=self.group)

    def receive(self) -> tuple[int, bytes]:
        header = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        op, n = int(header[0]), int(header[1])
        if not n:
            return op, b""
        buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.group)
        return op, buf.numpy().tobytes()


def encode_step(batches: list[TrainingBatch], sequences: int) -> bytes:
    """`OP_STEP`'s payload: int64 sequences, int64 count, then each batch as int64 length + bytes."""
    serde = default_serde()
    parts = [struct.pack("<qq", sequences, len(batches))]
    for b in batches:
        raw = serde.encode(b)
        parts.append(struct.pack("<q", len(raw)) + raw)
    return b"".join(parts)


def decode_step(payload: bytes) -> tuple[list[TrainingBatch], int]:
    """The inverse of `encode_step`: `(batches, sequences)`."""
    serde = default_serde()
    sequences, count = struct.unpack_from("<qq", payload)
    pos, out = 16, []
    for _ in range(count):
        (n,) = struct.unpack_from("<q", payload, pos)
        out.append(serde.decode(payload[pos + 8 : pos + 8 + n], TrainingBatch))
        pos += 8 + n
    return out, sequences


def reduce_stats(stats: TokenStats, group: Any) -> TokenStats:
    """This rank's token statistics combined over `group` (collective): sums, `ratio_max` by max."""
    names = [f.name for f in fields(TokenStats) if f.name != "ratio_max"]
    summed = torch.tensor([float(getattr(stats, n)) for n in names], dtype=torch.float64)
    peak = torch.tensor([stats.ratio_max], dtype=torch.float64)
    dist.all_reduce(summed, group=group)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    out = TokenStats()
    for n, v in zip(names, summed.tolist(), strict=True):
        setattr(out, n, type(getattr(stats, n))(v))
    out.ratio_max = float(peak.item())
    return out


def is_follower() -> bool:
    """True on ranks > 0 of a distributed launch (after the backend's `init_distributed`)."""
    return dist.is_initialized() and dist.get_rank() != 0


def shutdown() -> None:
    """Destroy this rank's process groups at a normal end (rank 0 after its run, the others after
    STOP). A gloo group left to the interpreter's exit can abort the process there (SIGABRT,
    `terminate called without an active exception`: its worker threads release tensors after the
    interpreter is gone, pytorch/pytorch#190489), which torchrun reports as the launch failing
    (seen once in CI: rank 1 of the ZeRO-3 test, after its last version)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class RankZero:
    """What a data-parallel backend's rank 0 does for the `PolicyTrainer` interface, the same for
    DeepSpeed and FSDP2: buffer micro-batches, send each command to the followers over `control`,
    then run it itself. A backend sets `cfg`, `rank`, `control`, `_vocab` and `_pending` and
    implements `_step`, `_save`, `_load` and `full_weights` (what every rank runs)."""

    cfg: TrainerConfig
    rank: int
    control: Control
    _vocab: int
    _pending: list[TrainingBatch]

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def micro_batch(self, samples: list[TrainingSample]) -> MicroResult:
        """Buffer the micro-batch; it is trained by `optimizer_step` (on every rank at once)."""
        from stream_rl.train.rows import pack_samples
        from stream_rl.train.step import MicroResult

        self._pending.append(TrainingBatch("pending", "", list(samples), "trainer"))
        packed = pack_samples(samples, self.cfg.pack_row_tokens)
        return MicroResult(0.0, TokenStats(), packed.real_tokens, packed.padded_tokens)

    def optimizer_step(self, num_sequences: int) -> StepOutcome:
        batches, self._pending = self._pending, []
        self.control.send(OP_STEP, encode_step(batches, num_sequences))
        return self._step(batches, num_sequences)

    def checksum(self) -> str:
        from stream_rl.weights.checksum import weights_checksum

        with self.full_weights() as named:
            return weights_checksum(named)

    def save_to(self, directory: Path) -> None:
        self.control.send(OP_SAVE, str(directory).encode())
        self._save(directory)

    def load_from(self, directory: Path) -> None:
        self.control.send(OP_LOAD, str(directory).encode())
        self._load(directory)

    def close(self) -> None:
        if self.rank == 0:
            self.control.send(OP_STOP)

    def full_weights(self) -> AbstractContextManager[list[tuple[str, torch.Tensor]]]:
        raise NotImplementedError

    def _step(self, batches: list[TrainingBatch], sequences: int) -> StepOutcome:
        raise NotImplementedError

    def _save(self, directory: Path) -> None:
        raise NotImplementedError

    def _load(self, directory: Path) -> None:
        raise NotImplementedError
