"""``bargein cluster [--url URL]``: the stages or replicas of a server's model, from ``GET /v1/cluster``;
``bargein cluster start | join | check``: the Ray cluster itself (:mod:`bargein.cli.cluster_nodes`).

Exit statuses as the other client commands: 0 success, 1 the server cannot be reached
or answers with an error.
"""

from __future__ import annotations

import argparse
from typing import Any

# Not httpx here (nor bargein.cli.client, which imports it): `bargein serve` builds every
# command's arguments, and httpx with what it pulls in is ~0.1 s of its start-up.
from bargein.cli import cluster_nodes
from bargein.cli.common import Command, add_server_arguments
from bargein.cli.errors import ClientError


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    add_server_arguments(p, url_help="the bargein server (default: $BARGEIN_URL or %(default)s)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=False)
    for name, add, run, help_ in (
            ("start", cluster_nodes.add_start_arguments, cluster_nodes.run_start,
             "start the Ray head on this machine, with token authentication"),
            ("join", cluster_nodes.add_join_arguments, cluster_nodes.run_join,
             "join this machine to a head started by `bargein cluster start`"),
            ("check", cluster_nodes.add_check_arguments, cluster_nodes.run_check,
             "check every node of the Ray cluster: versions, bargein installed, routes")):
        sub = actions.add_parser(name, help=help_, description=help_)
        add(sub)
        sub.set_defaults(run=run)


def run_cluster(args: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/") + "/v1/cluster"
    try:
        response = httpx.get(url, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise ClientError(f"cannot reach {args.url}: {exc}") from None
    if response.status_code != 200:
        raise ClientError(f"{url} answered {response.status_code}: {response.text[:200]}")
    print(format_cluster(response.json()))
    return 0


def format_cluster(info: dict[str, Any]) -> str:
    """A summary line (health, recoveries, head traffic), then one line per stage:
    layers, node, compute threads, memory, weights' origin, plans, mean step, mean
    transfer in, idle, restarts."""
    if info.get("replicas"):
        return format_replicas(info)
    if not info.get("pipeline"):
        return f"one process, {info.get('kv_blocks', '?')} KV blocks (no pipeline)"
    traffic = info.get("head_traffic", {})
    lines = [f"{info['num_stages']} stages ({info.get('transport') or '?'} transport), "
             f"{info['max_in_flight']} micro-batches in flight, "
             f"{info['kv_blocks']} KV blocks; head traffic {traffic.get('total', 0) / 2**20:.1f} MiB"]
    recovery = info.get("recovery", {})
    health = info.get("health", "ok")
    summary = f"health {health}"
    if info.get("health_message"):
        summary += f": {info['health_message']}"
    summary += f"; {recovery.get('recoveries', 0)} recoveries"
    if recovery.get("last_recover_s") is not None:
        summary += f" (last took {recovery['last_recover_s']:.1f} s)"
    if recovery.get("tokens_recomputed"):
        summary += f", {recovery['tokens_recomputed']} tokens recomputed"
    lines.append(summary)
    if info.get("split"):
        lines.append(f"layers split {info['split']}")
    if info.get("wait_policy"):
        lines.append(f"stage threads wait with {info['wait_policy']}")
    header = ("STAGE", "LAYERS", "NODE", "THREADS", "MEMORY", "WEIGHTS", "PLANS", "STEP", "XFER", "IDLE", "RESTARTS")
    rows = []
    for s in info["stages"]:
        where = (str(s["index"]), f"{s['layers'][0]}-{s['layers'][1]}", s["node_address"], str(s.get("threads") or "?"),
                 f"{s['node_memory_bytes'] / 2**30:.1f}GiB")
        if s.get("state", "ok") != "ok":  # lost, being re-created: no counters to show
            rows.append((*where, s["state"], "-", "-", "-", "-", str(s.get("restarts", 0))))
            continue
        step = "-" if s.get("mean_step_ms") is None else f"{s['mean_step_ms']:.1f}ms"
        xfer = "-" if s.get("mean_transfer_ms") is None else f"{s['mean_transfer_ms']:.2f}ms"
        rows.append((*where, s["weights_from"], str(s["plans"]), step, xfer,
                     f"{100 * s['idle_fraction']:.0f}%", str(s.get("restarts", 0))))
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in (header, *rows)]
    return "\n".join(lines)


def format_replicas(info: dict[str, Any]) -> str:
    """One line per engine replica: up, node, threads, routing weight (its measured speed's
    share of the fastest), load, routed, cache hit rates, losses; then the stages of
    replicas that are pipelines."""
    lines = [f"{info['num_replicas']} replicas ({info['routing']} routing), {info['kv_blocks']} KV blocks each; "
             f"{info.get('resubmitted', 0)} requests resubmitted after a loss"]
    header = ("REPLICA", "UP", "NODE", "THREADS", "SPEED", "LOAD", "ROUTED", "HIT", "PREDICTED", "MOVED", "LOST")
    rows = []
    for r in info["replicas"]:
        node = str(r.get("node_address") or r.get("node_id", "?"))[:15]  # an address; an id before it answered
        rows.append((str(r["index"]), "yes" if r["up"] else "no", node, str(r.get("threads") or "?"),
                     f"x{r.get('speed', 1.0):.2f}", str(r["load"]),
                     str(r["routed"]), f"{100 * r.get('cache_hit_rate', 0.0):.0f}%",
                     f"{100 * r['predicted_hit_rate']:.0f}%", f"{r['moved_out']}", f"{r['lost']}"))
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in (header, *rows)]
    for r in info["replicas"]:  # a replica that is a pipeline: its stages, one line each
        for s in r.get("stages", ()):
            lines.append(f"  replica {r['index']} stage {s['index']}: layers {s['layers'][0]}-{s['layers'][1]} on "
                         f"{s.get('node_address', '?')}, {s.get('state', 'ok')}, weights {s.get('weights_from', '-')}")
    return "\n".join(lines)


COMMAND = Command("show the pipeline stages or replicas of a server's model", add_cluster_arguments, run_cluster)
