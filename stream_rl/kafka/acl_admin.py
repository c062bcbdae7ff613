"""`stream-rl acls plan|apply`: the run's ACLs (`stream_rl.kafka.acls`) printed, or made so on the
cluster through Kafka's Admin API (describe, create, and with `--delete-extra` delete ACLs).

`apply` creates the planned bindings that are missing and reports the bindings on the run's
resources that the plan does not hold (`acls.in_scope`): exit 1 while any is left, as `topics
apply` does on drift; `--delete-extra` deletes them (each by an exact filter). A second apply has
nothing to do. Run it as a principal allowed to change ACLs (ALTER on the cluster, a super user).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from stream_rl.cli import add_common
from stream_rl.errors import ConfigError, KafkaError
from stream_rl.kafka.acls import Acl, PlannedAcl, in_scope, plan_acls, plan_json, plan_table
from stream_rl.kafka.topics import TopicNames


class AclAdmin(Protocol):
    """The ACL calls `apply` makes (`KafkaAcls` on a cluster; a fake in unit tests)."""

    def describe(self) -> set[Acl]: ...

    def create(self, acls: list[Acl]) -> None: ...

    def delete(self, acls: list[Acl]) -> None: ...


@dataclass
class AclReport:
    created: list[Acl]
    present: list[Acl]
    extra: list[Acl]
    """Bindings on the run's resources that the plan does not hold."""
    deleted: list[Acl]


def apply_acls(
    admin: AclAdmin, planned: Iterable[PlannedAcl], names: TopicNames, *, delete_extra: bool = False
) -> AclReport:
    """Create the missing planned bindings; report (and with `delete_extra` delete) the extra ones."""
    wanted = {row.acl for row in planned}
    existing = admin.describe()
    principals = {acl.principal for acl in wanted}
    missing = sorted(wanted - existing)
    extra = sorted(a for a in existing - wanted if in_scope(a, names, principals))
    if missing:
        admin.create(missing)
    if extra and delete_extra:
        admin.delete(extra)
    return AclReport(
        created=missing,
        present=sorted(wanted & existing),
        extra=[] if delete_extra else extra,
        deleted=extra if delete_extra else [],
    )


def _row(acl: Acl) -> str:
    return f"{acl.principal} {acl.operation} {acl.resource_type} {acl.name} ({acl.pattern_type}, {acl.permission})"


_LIBRARY_TYPE = {"CLUSTER": "BROKER"}
"""Kafka's resource type 4, CLUSTER, is `ResourceType.BROKER` in confluent-kafka."""


class KafkaAcls:
    """`AclAdmin` over confluent-kafka's AdminClient; library errors become one-line KafkaErrors."""

    def __init__(self, admin: Any, bootstrap: str, timeout_s: float = 30.0) -> None:
        self.admin, self.bootstrap, self.timeout_s = admin, bootstrap, timeout_s

    @staticmethod
    def binding(acl: Acl) -> Any:
        from confluent_kafka.admin import (
            AclBinding,
            AclOperation,
            AclPermissionType,
            ResourcePatternType,
            ResourceType,
        )

        return AclBinding(
            ResourceType[_LIBRARY_TYPE.get(acl.resource_type, acl.resource_type)],
            acl.name,
            ResourcePatternType[acl.pattern_type],
            acl.principal,
            acl.host,
            AclOperation[acl.operation],
            AclPermissionType[acl.permission],
        )

    @staticmethod
    def acl(binding: Any) -> Acl:
        return Acl(
            principal=binding.principal,
            resource_type={v: k for k, v in _LIBRARY_TYPE.items()}.get(
                binding.restype.name, binding.restype.name
            ),
            name=binding.name,
            pattern_type=binding.resource_pattern_type.name,
            operation=binding.operation.name,
            permission=binding.permission_type.name,
            host=binding.host,
        )

    def _error(self, what: str, exc: Any) -> KafkaError:
        import confluent_kafka as ck

        err = exc.args[0] if exc.args and isinstance(exc.args[0], ck.KafkaError) else None
        code = err.code() if err is not None else None
        if code == ck.KafkaError.SECURITY_DISABLED:
            return KafkaError(
                f"Kafka at {self.bootstrap} has no authorizer (SECURITY_DISABLED): it keeps no ACLs; "
                "start its brokers with authorizer.class.name="
                "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
            )
        if code == ck.KafkaError.CLUSTER_AUTHORIZATION_FAILED:
            return KafkaError(
                f"Kafka at {self.bootstrap} refused to {what} (CLUSTER_AUTHORIZATION_FAILED): the "
                "principal of kafka.client_properties lacks ALTER on the cluster; run `acls apply` "
                "as a super user"
            )
        message = err.str() if err is not None else str(exc)
        return KafkaError(f"{what} at {self.bootstrap}: {message.splitlines()[0][:300]}")

    def describe(self) -> set[Acl]:
        import confluent_kafka as ck
        from confluent_kafka.admin import (
            AclBindingFilter,
            AclOperation,
            AclPermissionType,
            ResourcePatternType,
            ResourceType,
        )

        # None: any name, principal, host (confluent-kafka's stubs say str; its API takes None).
        anything: Any = None
        everything = AclBindingFilter(
            ResourceType.ANY,
            anything,
            ResourcePatternType.ANY,
            anything,
            anything,
            AclOperation.ANY,
            AclPermissionType.ANY,
        )
        try:
            found = self.admin.describe_acls(everything, request_timeout=self.timeout_s).result()
        except ck.KafkaException as exc:
            raise self._error("describe ACLs", exc) from exc
        return {self.acl(b) for b in found}

    def create(self, acls: list[Acl]) -> None:
        import confluent_kafka as ck

        futures = self.admin.create_acls([self.binding(a) for a in acls], request_timeout=self.timeout_s)
        for fut in futures.values():
            try:
                fut.result()
            except ck.KafkaException as exc:
                raise self._error("create ACLs", exc) from exc

    def delete(self, acls: list[Acl]) -> None:
        import confluent_kafka as ck
        from confluent_kafka.admin import AclBindingFilter

        filters = []
        for acl in acls:  # every field given: the filter matches this binding only
            b = self.binding(acl)
            filters.append(
                AclBindingFilter(
                    b.restype,
                    b.name,
                    b.resource_pattern_type,
                    b.principal,
                    b.host,
                    b.operation,
                    b.permission_type,
                )
            )
        futures = self.admin.delete_acls(filters, request_timeout=self.timeout_s)
        for fut in futures.values():
            try:
                fut.result()
            except ck.KafkaException as exc:
                raise self._error("delete ACLs", exc) from exc


def add_acls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=["plan", "apply"],
        help="plan: print each principal's ACLs; apply: create the missing ones on the cluster",
    )
    p.add_argument("--json", action="store_true", help="plan: print the rows as JSON")
    p.add_argument(
        "--strimzi",
        metavar="CLUSTER",
        default=None,
        help="plan: print one Strimzi KafkaUser per principal (of the Kafka resource CLUSTER) instead",
    )
    p.add_argument(
        "--delete-extra",
        action="store_true",
        help="apply: also delete the bindings on the run's resources that the plan does not hold",
    )
    add_common(p)


def main_acls(args: argparse.Namespace) -> int:
    from stream_rl.config import load_config

    if not args.config and not args.overrides:
        raise ConfigError("acls: pass --config (the run config whose kafka.principals name the principals)")
    cfg = load_config(args.config, args.overrides)
    names = TopicNames(run=cfg.run, prefix=cfg.kafka.prefix)
    rows = plan_acls(names, cfg.kafka.principals.model_dump())
    if args.action == "plan":
        if args.strimzi:
            from stream_rl.kafka.strimzi import users_yaml

            print(users_yaml(rows, args.strimzi), end="")
            return 0
        print(plan_json(rows) if args.json else plan_table(rows))
        return 0
    from stream_rl.kafka.confluent import KafkaTransport

    transport = KafkaTransport.for_run(cfg.kafka, args.bootstrap)
    transport.check_reachable()
    report = apply_acls(
        KafkaAcls(transport.admin, transport.bootstrap), rows, names, delete_extra=args.delete_extra
    )
    print(
        f"run {names.run} on {transport.bootstrap}: {len(report.created)} ACL bindings created, "
        f"{len(report.present)} already there"
        + (f", {len(report.deleted)} extra deleted" if report.deleted else "")
        + ("" if report.created or report.extra or report.deleted else "; nothing to do")
    )
    for acl in report.created:
        print(f"  created: {_row(acl)}")
    for acl in report.deleted:
        print(f"  deleted: {_row(acl)}")
    for acl in report.extra:
        print(f"  extra, not in the plan (--delete-extra deletes it): {_row(acl)}")
    return 1 if report.extra else 0
