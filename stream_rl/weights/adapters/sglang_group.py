"""The trainer's side of SGLang's weight-update group, and the layout of SGLang's flattened buckets.

SGLang 0.5.23 forms the group in each TP worker with its `init_custom_process_group`
(model_executor/model_runner_components/weight_updater.py:100-144; utils/common.py:2859-2920):
a TCP rendezvous at `tcp://master_address:master_port` as rank `rank_offset + tp_rank`, the
store wrapped in `PrefixStore(group_name, store)`, then torch's process-group helper registering
the group under `group_name` (torch refuses a name already registered in the process, so a name
is never reused while the server lives). `join_group` does the same as rank 0 (which hosts the
TCP store), with our rendezvous timeout; SGLang's request carries no timeout
(io_struct.py:2126-2139), so the server side waits torch's default (30 minutes).

We form the group ourselves rather than import SGLang's helper: the trainer's environment has no
SGLang (its wheel pins torch, transformers and CUDA kernel packages of its own). Both sides then
run torch's own helper, so their store keys agree as long as torch's layout does between the
trainer's and the server's torch releases (UNVERIFIED on GPU; the same rendezvous over gloo is
tested on CPU: tests/integration/test_sglang_over_gloo.py, and against SGLang's own helper by
tests/data/sglang-0.5.23/sglang_bodies.py group).

`load_format: "flattened_bucket"` (model_runner_components/weight_updater.py:260-310; weight_sync/tensor_bucket.py:86-133):
the server allocates one uint8 buffer holding the listed tensors back to back in list order,
each starting at a byte offset that must be a multiple of its dtype's size, receives it in one
broadcast and views each tensor out of it. `plan_buckets` keeps one dtype per bucket, so every
offset is aligned; `pack` builds the matching buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch

NamedTensors = Sequence[tuple[str, torch.Tensor]]


def tcp_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def join_group(
    *, master_addr: str, master_port: int, world_size: int, group_name: str, timeout_s: float, backend: str
) -> Any:
    """Join SGLang's group `group_name` as rank 0 (hosting its TCP store); returns the group.
    Blocks until every server rank has joined, at most `timeout_s`."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(c10d.rendezvous(tcp_url(master_addr, master_port), 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size,
        0,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=c10d.GroupName(group_name),
        timeout=timeout,
    )
    # Rank i of the group is global rank i (as SGLang records it), so src=0 means us.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class Work(Protocol):
    def is_completed(self) -> bool: ...

    def wait(self) -> object: ...


class Collectives(Protocol):
    """The collectives the sender needs; `TorchCollectives` on GPUs, a fake in unit tests."""

    def join(
        self, *, master_addr: str, master_port: int, world_size: int, group_name: str, timeout_s: float
    ) -> Any: ...

    def broadcast(self, group: Any, tensor: torch.Tensor) -> Work:
        """Start broadcasting `tensor` from rank 0 (us); returns at once."""
        ...

    def destroy(self, group: Any) -> None: ...


class TorchCollectives:
    """torch.distributed over `backend` (`nccl` against SGLang; `gloo` in the CPU test)."""

    def __init__(self, backend: str = "nccl") -> None:
        self.backend = backend

    def join(
        self, *, master_addr: str, master_port: int, world_size: int, group_name: str, timeout_s: float
    ) -> Any:
        return join_group(
            master_addr=master_addr,
            master_port=master_port,
            world_size=world_size,
            group_name=group_name,
            timeout_s=timeout_s,
            backend=self.backend,
        )

    def broadcast(self, group: Any, tensor: torch.Tensor) -> Work:
        work: Work = torch.distributed.broadcast(tensor, src=0, group=group, async_op=True)
        return work

    def destroy(self, group: Any) -> None:
        torch.distributed.destroy_process_group(group)


def plan_buckets(named_tensors: NamedTensors, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of tensors of one dtype, each at most `bucket_bytes` (a larger tensor
    travels alone)."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        current = buckets[-1] if buckets else None
        if current is None or current[0][1].dtype != tensor.dtype or size + nbytes > bucket_bytes:
            buckets.append([(name, tensor)])
            size = nbytes
        else:
            current.append((name, tensor))
            size += nbytes
    return buckets


def pack(bucket: NamedTensors) -> torch.Tensor:
    """The bucket's tensors as one flat uint8 tensor, in order (SGLang's flattened layout)."""
    flat = [tensor.detach().contiguous().reshape(-1).view(torch.uint8) for _, tensor in bucket]
    return flat[0] if len(flat) == 1 else torch.cat(flat)
