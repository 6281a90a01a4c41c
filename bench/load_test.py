"""Load test: many concurrent streaming clients that finish, disconnect, or cancel by id.

Starts its own ``bargein serve`` (the bundled model, debug endpoints on) unless
``--url`` names a running one, then runs ``--clients`` concurrent streaming chat
clients for ``--duration`` seconds. Each request picks a behaviour: a share of them
(``--disconnect-share``, a third by default) hang up after a random number of chunks,
some (``--cancel-share``) cancel themselves by id with ``POST /v1/requests/{id}/cancel``
and read on to the cancelled chunk, the rest read to the end.

Prints a table, then one JSON object on the last line: requests by outcome, errors
(expected 0), tokens/s, time to first token, inter-token latency and cancel latency
percentiles, and the final KV block accounting (no blocks may stay referenced).

    .venv/bin/python bench/load_test.py [--duration 60] [--clients 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import format_table, histogram_quantile, machine_info, percentile, rnd  # noqa: E402

from tests.conftest import ServerProcess  # noqa: E402  (the tests' way of running bargein serve)

PROMPTS = [
    "Tell me a story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Write a poem about the sea.",
    "List some facts about the moon.",
    "Describe a busy market in the morning.",
    "What makes a good cup of tea?",
]


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    cancel_latency: list[float] = field(default_factory=list)
    tokens: int = 0  # completion tokens delivered to clients

    def error(self, message: str) -> None:
        self.outcomes["error"] += 1
        if len(self.errors) < 20:
            self.errors.append(message)


async def one_request(http: httpx.AsyncClient, base: str, rng: random.Random, args, tally: Tally, n: int) -> None:
    behaviour = rng.choices(["disconnect", "cancel", "complete"],
                            [args.disconnect_share, args.cancel_share,
                             1 - args.disconnect_share - args.cancel_share])[0]
    rid = f"load-{n}"
    stop_after = rng.randint(1, 24)
    body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "stream": True,
            "max_tokens": rng.randint(args.min_tokens, args.max_tokens), "temperature": 0.8,
            "stream_options": {"include_usage": True}}
    started = time.monotonic()
    last = None
    pieces = 0
    cancel_sent = None
    finish = None
    usage = None
    done = False
    try:
        async with http.stream("POST", f"{base}/v1/chat/completions", json=body, headers={"X-Request-Id": rid}) as r:
            if r.status_code != 200:
                tally.error(f"{rid}: HTTP {r.status_code} {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    tally.error(f"{rid}: {chunk['error']}")
                    return
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    if choice["delta"].get("content"):
                        now = time.monotonic()
                        if last is None:
                            tally.ttft.append(now - started)
                        else:
                            tally.itl.append(now - last)
                        last = now
                        pieces += 1
                    if choice["finish_reason"]:
                        finish = choice["finish_reason"]
                        if cancel_sent is not None:
                            tally.cancel_latency.append(time.monotonic() - cancel_sent)
                if behaviour == "disconnect" and pieces >= stop_after:
                    tally.outcomes["disconnected"] += 1
                    tally.tokens += pieces
                    return  # leaving the block closes the connection
                if behaviour == "cancel" and pieces >= stop_after and cancel_sent is None and finish is None:
                    cancel_sent = time.monotonic()
                    c = await http.post(f"{base}/v1/requests/{rid}/cancel")
                    if c.status_code != 200:
                        tally.error(f"{rid}: cancel answered {c.status_code}")
                        return
    except httpx.HTTPError as exc:
        tally.error(f"{rid}: {type(exc).__name__}: {exc}")
        return
    if not done or finish is None:
        tally.error(f"{rid}: stream ended without a finish reason and [DONE]")
        return
    tally.tokens += usage["completion_tokens"] if usage else pieces
    if finish == "cancelled":
        tally.outcomes["cancelled_by_id" if cancel_sent is not None else "cancelled_unexpectedly"] += 1
        if cancel_sent is None:
            tally.error(f"{rid}: cancelled without a cancel")
    elif behaviour == "cancel":
        tally.outcomes["finished_before_cancel"] += 1
    else:
        tally.outcomes[f"completed_{finish}"] += 1


async def client_loop(index: int, base: str, args, tally: Tally, deadline: float, counter: list[int]) -> None:
    rng = random.Random(args.seed * 1000 + index)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30)) as http:
        while time.monotonic() < deadline:
            counter[0] += 1
            await one_request(http, base, rng, args, tally, counter[0])


def metric(text: str, name: str, labels: str = "", missing: float = 0.0) -> float:
    """A sample from Prometheus text; a counter not yet written is 0."""
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else missing


async def run(args, base: str) -> dict:
    async with httpx.AsyncClient(timeout=30) as http:
        before = (await http.get(f"{base}/metrics")).text
    tally = Tally()
    counter = [0]
    started = time.monotonic()
    deadline = started + args.duration
    await asyncio.gather(*(client_loop(i, base, args, tally, deadline, counter) for i in range(args.clients)))
    elapsed = time.monotonic() - started
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(600):  # let disconnects settle: at most one step each
            kv = (await http.get(f"{base}/debug/kv")).json()
            if not (kv["running"] or kv["waiting"] or kv["engine_live_requests"]):
                break
            await asyncio.sleep(0.1)
        after = (await http.get(f"{base}/metrics")).text
        listed = (await http.get(f"{base}/v1/requests")).json()["data"]
    generated = metric(after, "bargein_generation_tokens_total") - metric(before, "bargein_generation_tokens_total")
    cancelled = {r: metric(after, "bargein_requests_cancelled_total", f'{{cancel_reason="{r}"}}')
                 - metric(before, "bargein_requests_cancelled_total", f'{{cancel_reason="{r}"}}')
                 for r in ("user", "disconnect", "deadline", "shutdown")}
    return {
        "clients": args.clients, "duration_s": elapsed, "requests": sum(tally.outcomes.values()),
        "outcomes": dict(sorted(tally.outcomes.items())), "errors": tally.outcomes.get("error", 0),
        "error_samples": tally.errors,
        "engine_cancelled_by_reason": {k: int(v) for k, v in cancelled.items()},
        "tokens_delivered": tally.tokens, "tokens_per_s_delivered": tally.tokens / elapsed,
        "tokens_generated": generated, "tokens_per_s_generated": generated / elapsed,
        "ttft_p50_s": percentile(tally.ttft, 50), "ttft_p99_s": percentile(tally.ttft, 99),
        "itl_p50_s": percentile(tally.itl, 50), "itl_p99_s": percentile(tally.itl, 99),
        "cancel_latency_client_p50_s": percentile(tally.cancel_latency, 50),
        "cancel_latency_client_p99_s": percentile(tally.cancel_latency, 99),
        "cancel_latency_engine_p50_s": histogram_quantile(before, after, "bargein_cancel_latency_seconds", 0.5),
        "cancel_latency_engine_p99_s": histogram_quantile(before, after, "bargein_cancel_latency_seconds", 0.99),
        "cancel_latency_engine_p99_steps": histogram_quantile(before, after, "bargein_cancel_latency_steps", 0.99,
                                                              interpolate=False),
        "kv": {"ok": kv["ok"], "error": kv["error"], "blocks_total": kv["kv_blocks_total"],
               "blocks_used": kv["kv_blocks_used"], "blocks_cached": kv["kv_blocks_cached"],
               "blocks_free": kv["kv_blocks_free"], "requests_left": len(listed) + kv["engine_live_requests"]},
        "leaked_blocks": kv["kv_blocks_used"],
        "machine": machine_info(),
    }


def report(result: dict) -> None:
    rows = [{"metric": k, "value": v} for k, v in result["outcomes"].items()]
    rows += [{"metric": k, "value": result[k]} for k in (
        "requests", "errors", "tokens_per_s_delivered", "tokens_per_s_generated", "ttft_p50_s", "ttft_p99_s",
        "itl_p50_s", "itl_p99_s", "cancel_latency_client_p50_s", "cancel_latency_client_p99_s",
        "cancel_latency_engine_p50_s", "cancel_latency_engine_p99_s", "cancel_latency_engine_p99_steps",
        "leaked_blocks")]
    rows += [{"metric": f"engine cancelled ({k})", "value": v} for k, v in result["engine_cancelled_by_reason"].items()]
    rows.append({"metric": "kv accounting ok", "value": result["kv"]["ok"]})
    print(f"load test: {result['clients']} streaming clients for {result['duration_s']:.0f} s")
    print(format_table(rows, ["metric", "value"]))
    for sample in result["error_samples"]:
        print("error:", sample)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default: %(default)s)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--disconnect-share", type=float, default=1 / 3)
    p.add_argument("--cancel-share", type=float, default=0.15)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="a running server (started with --debug-endpoints) instead of starting one")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for bargein serve")
    p.add_argument("--json", metavar="PATH", help="also write the JSON result to PATH")
    args = p.parse_args()
    server = None
    if args.url:
        base = args.url.rstrip("/")
    else:
        server = ServerProcess(("--debug-endpoints", *args.server_arg)).start().wait_ready()
        base = server.base_url
    try:
        result = rnd(asyncio.run(run(args, base)))
    finally:
        if server is not None:
            server.stop()
    report(result)
    line = json.dumps(result)
    if args.json:
        Path(args.json).write_text(line + "\n")
    print(line)
    ok = result["errors"] == 0 and result["leaked_blocks"] == 0 and result["kv"]["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
