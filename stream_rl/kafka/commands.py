"""CLI commands of the Kafka layer: `kafka`, `topics`, `lag`, `hanging`."""

from __future__ import annotations

import argparse

from stream_rl.cli import add_common
from stream_rl.config import DEFAULT_PREFIX, KafkaConfig, load_config
from stream_rl.errors import StreamRLError
from stream_rl.kafka.broker import KAFKA_VERSION, LocalBroker, fetch_jars, resolve_bootstrap
from stream_rl.kafka.secure import ENROLLED as ENROLLED_ROLES
from stream_rl.kafka.topics import TopicNames, apply_topics, publish_schemas


def add_kafka_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["fetch", "up", "down", "status", "compose-secrets", "users"])
    p.add_argument("--data-dir", default=".kafka", help="broker data dir (default .kafka)")
    p.add_argument("--port", type=int, default=9092, help="client port (default 9092)")
    p.add_argument(
        "--host",
        default=None,
        help="up: the address the client listener binds and advertises (default 127.0.0.1; for "
        "clients on other hosts, this host's address they reach it at)",
    )
    p.add_argument(
        "--brokers",
        type=int,
        default=None,
        help="up: a local KRaft cluster of N nodes on ports PORT..PORT+N-1 (default 1; down and "
        "status find a cluster by its data dir)",
    )
    p.add_argument(
        "--secure",
        action="store_true",
        help="up: a broker that authenticates (SCRAM-SHA-512 over TLS, mutual TLS) and authorizes "
        "with ACLs, one user per kind of process of the run (docs/security.md)",
    )
    p.add_argument(
        "--run", default=None, help="up --secure: the run to enroll (default: --config's run, else demo)"
    )
    p.add_argument(
        "--config",
        default=None,
        help="up --secure: a run config; its run name and prefix are enrolled and a copy with the "
        "secure kafka: section is written. compose-secrets: the run config the Compose services get "
        "(default configs/demo-docker.yaml). users: the config whose principals to create, as its operator",
    )
    p.add_argument(
        "--out",
        default="deploy/compose/.secrets",
        help="compose-secrets: where to write the secured Compose variant's CA, certificates, "
        "passwords and per-service configs (default deploy/compose/.secrets; docs/security.md)",
    )
    p.add_argument(
        "--password-dir",
        default=None,
        help="users: the directory of `<role>.password` files; creates (or updates) the SCRAM user "
        "of each --config principal that has one",
    )
    p.add_argument("--quiet", action="store_true")


def main_kafka(args: argparse.Namespace) -> int:
    from stream_rl.kafka.cluster import LocalCluster, cluster_layout

    if args.action == "compose-secrets":
        return _compose_secrets(args)
    if args.action == "users":
        return _users(args)
    if args.secure or args.run or args.config:
        if args.action != "up":
            raise StreamRLError("--secure/--run/--config: only for `kafka up`")
        return _up_secure(args)
    layout = cluster_layout(args.data_dir)
    brokers = args.brokers or (len(layout.ports) if layout else 1)
    if brokers < 1:
        raise StreamRLError(f"--brokers {brokers}: need at least 1")
    if args.host is not None and (brokers > 1 or args.action != "up"):
        raise StreamRLError(
            "--host: only for `kafka up` of one broker (a local cluster listens on 127.0.0.1)"
        )
    if brokers > 1 and args.action != "fetch":
        cluster = LocalCluster(args.data_dir, brokers=brokers, port=args.port)
        if args.action == "up":
            print(cluster.up(quiet=args.quiet))
        elif args.action == "down":
            cluster.down(quiet=args.quiet)
        else:
            print(cluster.status())
        return 0
    if layout is not None and args.action != "fetch":
        raise StreamRLError(
            f"{args.data_dir} holds a {len(layout.ports)}-broker cluster: pass --brokers {len(layout.ports)}"
        )
    from stream_rl.kafka.secure import secure_listeners

    secured = secure_listeners(args.data_dir)  # a broker made by `up --secure`: status probes as the operator
    port = secured.ports.port if secured else args.port
    broker = LocalBroker(args.data_dir, port=port, host=args.host or "127.0.0.1", listener=secured)
    if args.action == "fetch":
        lib = fetch_jars(quiet=args.quiet)
        if not args.quiet:
            print(f"Kafka {KAFKA_VERSION} jars in {lib}")
    elif args.action == "up":
        st = broker.up(quiet=args.quiet)
        print(st.bootstrap)
    elif args.action == "down":
        broker.down(quiet=args.quiet)
    else:
        print(broker.status())
    return 0


def _up_secure(args: argparse.Namespace) -> int:
    """`kafka up --secure`: start (or reuse) the secured broker, enroll the run, print its files."""
    from pathlib import Path

    from stream_rl.common.ports import free_port
    from stream_rl.kafka.cluster import LocalCluster, cluster_layout
    from stream_rl.kafka.secure import SecureListeners, SecurePorts, enroll, secure_dir, secure_listeners

    if not args.secure:
        raise StreamRLError("--run/--config: only with `kafka up --secure`")
    cfg = load_config(args.config) if args.config else None
    run = args.run or (cfg.run if cfg is not None else "demo")
    prefix = cfg.kafka.prefix if cfg is not None else DEFAULT_PREFIX
    listeners = secure_listeners(args.data_dir)
    if listeners is None:
        if LocalBroker(args.data_dir).state() is not None or cluster_layout(args.data_dir) is not None:
            raise StreamRLError(
                f"{args.data_dir} holds a broker made without --secure: choose another --data-dir"
            )
        brokers = args.brokers or 1
        if brokers > 1 and args.host is not None:
            raise StreamRLError("--host: only for one broker (a local cluster listens on 127.0.0.1)")
        host = args.host or "127.0.0.1"
        # SASL_SSL on PORT..PORT+N-1, mutual TLS on the N ports after them.
        nodes = tuple(
            SecurePorts(host, args.port + i, args.port + brokers + i, free_port()) for i in range(brokers)
        )
        listeners = SecureListeners(secure_dir(args.data_dir), nodes[0], nodes if brokers > 1 else ())
    elif args.brokers is not None and args.brokers != len(listeners.all_nodes):
        raise StreamRLError(f"{args.data_dir} holds a secured {len(listeners.all_nodes)}-broker Kafka")
    listeners.prepare()
    if len(listeners.all_nodes) > 1:
        ports = [n.port for n in listeners.all_nodes]
        LocalCluster(args.data_dir, brokers=len(ports), ports=ports, secure=listeners).up(quiet=args.quiet)
    else:
        broker = LocalBroker(
            args.data_dir, port=listeners.ports.port, host=listeners.ports.host, listener=listeners
        )
        broker.up(quiet=args.quiet)
    enrolled = enroll(listeners, run, prefix, Path(args.config) if args.config else None)
    print(
        f"secured Kafka at {listeners.bootstrap} (SASL_SSL, SCRAM-SHA-512) and {listeners.mtls_bootstrap} (mutual TLS)"
    )
    print(f"run {run} enrolled: {len(ENROLLED_ROLES)} users, {enrolled.acls_created} ACL bindings created")
    print(f"kafka config (SCRAM): {enrolled.kafka_yaml}")
    print(f"kafka config (mutual TLS): {enrolled.mtls_yaml}")
    if enrolled.run_yaml is not None:
        print(f"run config: {enrolled.run_yaml}")
    return 0


def _compose_secrets(args: argparse.Namespace) -> int:
    """`kafka compose-secrets`: the secured Compose variant's material (stream_rl/kafka/compose_secrets.py)."""
    from pathlib import Path

    from stream_rl.kafka.compose_secrets import write_compose_secrets

    config = Path(args.config or "configs/demo-docker.yaml")
    if not config.is_file():
        raise StreamRLError(f"--config {config}: no such file")
    made = write_compose_secrets(config, Path(args.out), host_port=args.port)
    print(
        f"compose secrets in {made.out}: {len(made.created)} files made ({', '.join(made.created) or 'none'})"
    )
    return 0


def _users(args: argparse.Namespace) -> int:
    """`kafka users --config C --password-dir D`: the SCRAM users of C's principals, as its operator."""
    from pathlib import Path

    from stream_rl.kafka.confluent import KafkaTransport
    from stream_rl.kafka.secure import OPERATOR, upsert_scram_users

    if not args.config or not args.password_dir:
        raise StreamRLError("kafka users: needs --config (its principals) and --password-dir")
    cfg = load_config(args.config)
    passwords: dict[str, str] = {}
    for role, principal in cfg.kafka.principals.model_dump().items():
        file = Path(args.password_dir) / f"{role}.password"
        if role == OPERATOR or principal is None or not file.is_file():
            continue
        kind, _, name = principal.partition(":")
        if kind != "User":
            raise StreamRLError(f"kafka.principals.{role}: {principal} is no SCRAM user (User:NAME)")
        passwords[name] = file.read_text().strip()
    if not passwords:
        raise StreamRLError(
            f"kafka users: no principal of {args.config} has a password file in {args.password_dir}"
        )
    upsert_scram_users(KafkaTransport.for_run(cfg.kafka).admin, passwords)
    print(f"SCRAM users created or updated: {', '.join(sorted(passwords))}")
    return 0


def _names(args: argparse.Namespace) -> tuple[TopicNames, str, KafkaConfig]:
    """The run's topic names, bootstrap and Kafka config (defaults without --config/--set)."""
    cfg = load_config(args.config, args.overrides) if args.config or args.overrides else None
    run = args.run or (cfg.run if cfg else None)
    if not run:
        raise StreamRLError("which run? pass --run R (or --config with a `run:` name)")
    kafka = cfg.kafka if cfg else KafkaConfig()
    prefix = args.prefix or kafka.prefix
    bootstrap = resolve_bootstrap(args.bootstrap, kafka.bootstrap, kafka.data_dir)
    return TopicNames(run=run, prefix=prefix), bootstrap, kafka


def add_topics_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=["apply", "list", "table"],
        help="apply: create the run's topics; list: with record counts; table: the topology as Markdown",
    )
    p.add_argument("--run", help="run name (topic namespace)")
    p.add_argument("--prefix", default=None, help=f"topic prefix (default {DEFAULT_PREFIX})")
    p.add_argument("--partitions", type=int, default=None, help="partitions of the scalable topics")
    add_common(p)


def main_topics(args: argparse.Namespace) -> int:
    from stream_rl.kafka.confluent import KafkaTransport

    if args.action == "table":
        from stream_rl.kafka.topics import topology_markdown

        print(topology_markdown())
        return 0
    if args.action == "list" and not args.run and not args.config:
        transport = KafkaTransport.for_run(KafkaConfig(), args.bootstrap)
        prefix = (args.prefix or DEFAULT_PREFIX) + "."
        _print_counts(transport, [t for t in transport.list_topic_names() if t.startswith(prefix)])
        return 0
    names, bootstrap, kcfg = _names(args)
    transport = KafkaTransport.for_run(kcfg, bootstrap)
    transport.check_reachable()
    if args.action == "apply":
        report = apply_topics(
            transport,
            names,
            args.partitions or kcfg.partitions,
            replication_factor=kcfg.replication_factor,
            min_insync_replicas=kcfg.min_insync_replicas,
        )
        n = publish_schemas(transport, names)
        print(
            f"run {names.run} on {bootstrap}: {len(report.created)} topics created, "
            f"{len(report.existing)} already there; {n} schemas published to {names.topic('_schemas')}"
        )
        for line in report.drift:
            print(f"  differs from topology: {line}")
        return 1 if report.drift else 0
    wanted = [t[0] for t in names.all_topics()]
    existing = set(transport.list_topic_names())
    _print_counts(transport, [t for t in wanted if t in existing])
    missing = [t for t in wanted if t not in existing]
    if missing:
        print(f"missing (run `stream-rl topics apply --run {names.run}`): {', '.join(missing)}")
    return 0


def _print_counts(transport: object, topics: list[str]) -> None:
    from stream_rl.kafka.confluent import KafkaTransport

    assert isinstance(transport, KafkaTransport)
    rows = [("topic", "partitions", "records")]
    for t in topics:
        marks = transport.watermarks(t)
        rows.append((t, str(len(marks)), str(sum(h - lo for lo, h in marks.values()))))
    width = max(len(r[0]) for r in rows)
    for r in rows:
        print(f"{r[0]:<{width}}  {r[1]:>10}  {r[2]:>8}")


def add_lag_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", help="run name")
    p.add_argument("--prefix", default=None)
    p.add_argument("--no-age", action="store_true", help="skip reading the oldest record's timestamp")
    p.add_argument(
        "--serve-metrics",
        type=int,
        default=None,
        metavar="PORT",
        help="instead of printing once, export lag as Prometheus gauges on PORT until stopped",
    )
    p.add_argument("--every", type=float, default=5.0, help="refresh period with --serve-metrics (s)")
    add_common(p)


def main_lag(args: argparse.Namespace) -> int:
    from stream_rl.kafka.confluent import KafkaTransport
    from stream_rl.kafka.lag import format_lags, run_lags

    names, bootstrap, kcfg = _names(args)
    kafka = KafkaTransport.for_run(kcfg, bootstrap)
    kafka.check_reachable()
    if args.serve_metrics is None:
        print(format_lags(run_lags(kafka, names, with_age=not args.no_age)))
        return 0
    from stream_rl.common.metrics import serve_metrics
    from stream_rl.kafka.lag import LagExporter
    from stream_rl.kafka.stage import StopFlag

    stop = StopFlag()
    stop.install_signal_handlers()
    port = serve_metrics(args.serve_metrics, host="0.0.0.0")
    print(f"exporting lag of run {names.run} on :{port}/metrics every {args.every:g}s", flush=True)
    exporter = LagExporter(kafka, names)
    while not stop:
        exporter.refresh(with_age=not args.no_age)
        stop.wait(args.every)
    return 0


def add_hanging_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", help="run name")
    p.add_argument("--prefix", default=None)
    p.add_argument(
        "--abort",
        action="store_true",
        help="abort the hanging transactions found (default: only list them); the launcher does "
        "it by itself once no weight version came for a while",
    )
    p.add_argument(
        "--min-age",
        type=float,
        default=None,
        metavar="S",
        help="only transactions whose last write is S seconds old (default 30: twice the "
        "producers' transaction timeout)",
    )
    add_common(p)


def main_hanging(args: argparse.Namespace) -> int:
    """Exit 0: none hanging (or all aborted with --abort); 1: some hang (or an abort failed)."""
    from stream_rl.kafka.hanging import MIN_AGE_S, find_hanging, run_scope

    names, bootstrap, kcfg = _names(args)
    min_age = MIN_AGE_S if args.min_age is None else args.min_age
    if min_age < 0:
        raise StreamRLError(f"--min-age {min_age:g}: must be >= 0")
    topics, own = run_scope(names)
    found = find_hanging(
        kcfg, bootstrap, topics, transactional_prefix=own, abort=args.abort, min_age_s=min_age
    )
    if not found.ran:
        raise StreamRLError(f"could not look for hanging transactions of run {names.run}: {found.why}")
    for line in found.lines:
        print(line)
    left = [line for line in found.hanging if not line.endswith((": aborted", "(left alone)"))]
    print(
        f"run {names.run}: {len(found.lines)} open transactions, {len(found.hanging)} hanging, "
        f"{len(found.aborted)} aborted"
    )
    if found.why:
        print(found.why)
    return 1 if left or found.why else 0
