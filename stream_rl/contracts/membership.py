"""Inference servers joining and leaving a run (`servers`, compacted by url)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from stream_rl.contracts.core import now_ms, require

ENGINES = ("builtin", "vllm", "sglang")


class MembershipState(StrEnum):
    JOINED = "joined"
    DRAINING = "draining"
    LEFT = "left"


@dataclass(slots=True)
class ServerMembership:
    """One server's state in a run (see `schemas/ServerMembership.avsc`)."""

    SCHEMA: ClassVar[str] = "ServerMembership"
    run_id: str
    url: str
    engine: str
    state: MembershipState
    announced_by: str = ""
    created_ms: int = field(default_factory=now_ms)

    @property
    def routable(self) -> bool:
        """Joined: weights are pushed to it and (once current) requests routed to it."""
        return self.state == MembershipState.JOINED

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "url": self.url,
            "engine": self.engine,
            "state": self.state.value,
            "announced_by": self.announced_by,
            "created_ms": self.created_ms,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServerMembership:
        return cls(
            run_id=d["run_id"],
            url=d["url"],
            engine=d["engine"],
            state=MembershipState(d["state"]),
            announced_by=d.get("announced_by", ""),
            created_ms=d["created_ms"],
        )

    def validate(self) -> None:
        what = f"ServerMembership of {self.url!r}"
        require(
            self.url.startswith(("http://", "https://")) and not self.url.endswith("/"),
            f"{what}: url must be a base URL like http://host:port without a trailing '/'",
        )
        require(self.engine in ENGINES, f"{what}: engine must be one of {', '.join(ENGINES)}")
