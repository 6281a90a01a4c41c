"""``bargein cluster start | join | check``: a Ray cluster of machines, with its token.

    bargein cluster start [--node-ip IP] [--port 6379]          on the head machine
    bargein cluster join HEAD[:6379] --token-file FILE [--rejoin]   on every other machine
    bargein cluster check [--ray HEAD:6379]                      on the head: is it fit to run on?

``start`` makes the head's token where it has none (``~/.ray/auth_token``) and starts
Ray's head with token authentication; ``join`` installs the copied token, finds the
address this machine reaches the head from, and starts a Ray node there; both wrap
``ray start`` (see :mod:`bargein.distributed.join`) and print what to run next. With
``--rejoin``, ``join`` stays in the foreground and starts the node again whenever it left
the cluster (Ray declared it dead: :mod:`bargein.distributed.rejoin`).
``check`` lists the cluster's problems one line each (exit 1 when there is one).
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

from bargein.cli.errors import EXIT_SETUP, EXIT_USAGE, CliError


def add_node_arguments(p: argparse.ArgumentParser, *, head: bool) -> None:
    p.add_argument("--node-ip", default=None, metavar="IP",
                   help="the address other machines reach this one by (default: "
                        + ("the address of the default route" if head else "the one traffic to the head leaves from")
                        + ")")
    p.add_argument("--temp-dir", default=None, metavar="DIR", help="Ray's session files (default: /tmp/ray)")
    p.add_argument("--num-cpus", type=int, default=None, metavar="N", help="CPUs this node offers (default: all)")
    p.add_argument("--memory", default=None, metavar="SIZE",
                   help="memory this node offers; the layer split reads it (default: what is free)")
    p.add_argument("--object-store-memory", default=None, metavar="SIZE",
                   help="Ray's shared-memory object store here (default: Ray's, 30%% of memory)")


def add_start_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=6379, help="the head's port (default: %(default)s)")
    add_node_arguments(p, head=True)


def add_join_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("head", metavar="HEAD[:PORT]", help="the head's address, as `bargein cluster start` printed it")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="a copy of the head's ~/.ray/auth_token (default: the one this machine already holds, "
                        "or $RAY_AUTH_TOKEN)")
    p.add_argument("--rejoin", action="store_true",
                   help="stay in the foreground and join again whenever this node leaves the cluster (Ray declares "
                        "a machine dead when it is unreachable past its health checks, and never takes that node "
                        "back), once the head answers; run it as a service")
    add_node_arguments(p, head=False)


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", default="auto", metavar="auto|ADDRESS",
                   help="the cluster (default: the one this machine belongs to)")


def run_start(args: argparse.Namespace) -> int:
    from bargein.distributed.errors import PipelineSetupError
    from bargein.distributed.join import NodeStart, address_towards, ensure_token, token_path

    try:
        node_ip = args.node_ip or address_towards("192.0.2.1")  # TEST-NET: a route is looked up, nothing sent
    except PipelineSetupError:
        raise CliError("this machine has no default route: give --node-ip ADDRESS (the one the others reach it "
                       "by)", EXIT_USAGE) from None
    ensure_token()
    start = NodeStart(node_ip, port=args.port, **_node_resources(args))
    _ray_start(start)
    address = f"{node_ip}:{args.port}"
    print(f"bargein: Ray head started at {address} with token authentication.\n"
          f"  On each other machine: copy {token_path()} to it, then run\n"
          f"    bargein cluster join {address} --token-file COPY\n"
          f"  Then here: bargein serve --ray {address} --host {node_ip} (with --pipeline-stages N or --replicas N)",
          flush=True)
    return 0


def run_join(args: argparse.Namespace) -> int:
    from bargein.distributed.errors import PipelineSetupError
    from bargein.distributed.join import (
        NodeStart,
        address_towards,
        check_reachable,
        install_token,
        local_token,
        run_ray_start,
        split_address,
    )
    from bargein.distributed.rejoin import keep_joined, start_node

    try:
        host, port = split_address(args.head)
        if args.token_file is not None:
            try:
                install_token(Path(args.token_file).expanduser().read_text())
            except OSError as exc:
                raise CliError(f"--token-file {args.token_file}: {exc.strerror or exc}", EXIT_USAGE) from None
        elif local_token() is None:
            raise CliError("no token: copy the head's ~/.ray/auth_token to this machine and give it with "
                           "--token-file FILE (or set RAY_AUTH_TOKEN)", EXIT_SETUP)
        check_reachable(host, port)
        node_ip = args.node_ip or address_towards(host, port)
        start = NodeStart(node_ip, head_address=f"{host}:{port}", **_node_resources(args))
        raylet = start_node(start, run_ray_start)
    except PipelineSetupError as exc:
        raise CliError(str(exc), EXIT_SETUP) from None
    print(f"bargein: this machine ({node_ip}) joined the Ray cluster at {host}:{port}", flush=True)
    if args.rejoin:
        print("bargein: watching this node; it joins again whenever it leaves the cluster (Ctrl-C to stop "
              "watching; the node keeps running)", flush=True)
        keep_joined(start, run_ray_start, lambda line: print(f"bargein: {line}", flush=True), raylet,
                    threading.Event())
    return 0


def run_check(args: argparse.Namespace) -> int:
    from bargein.distributed.connect import check_cluster, connect
    from bargein.distributed.errors import PipelineSetupError

    try:
        connect(args.ray, 1, check=False)
        problems = check_cluster()
    except PipelineSetupError as exc:
        raise CliError(str(exc), EXIT_SETUP) from None
    import ray

    nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]
    if problems:
        raise CliError(str(problems), EXIT_SETUP)
    print(f"bargein: the Ray cluster is ready: {len(nodes)} nodes ({', '.join(sorted(nodes))})", flush=True)
    return 0


def _node_resources(args: argparse.Namespace) -> dict:
    from bargein.server.settings import parse_size

    sizes = {}
    for flag, value, key in (("--memory", args.memory, "memory_bytes"),
                             ("--object-store-memory", args.object_store_memory, "object_store_bytes")):
        try:
            sizes[key] = None if value is None else parse_size(value)
        except ValueError as exc:
            raise CliError(f"{flag}: {exc}", EXIT_USAGE) from None
    return {"temp_dir": args.temp_dir, "num_cpus": args.num_cpus, **sizes}


def _ray_start(start) -> None:
    """``ray start`` for ``start`` (:func:`~bargein.distributed.join.run_ray_start`), a failure one CliError line."""
    from bargein.distributed.errors import PipelineSetupError
    from bargein.distributed.join import run_ray_start

    try:
        run_ray_start(start)
    except PipelineSetupError as exc:
        raise CliError(str(exc), EXIT_SETUP) from None
