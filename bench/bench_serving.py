"""Serving benchmark: bargein serve against llama-server over HTTP, as the field measures servers.

Starts each server in turn on loopback (same GGUF, same threads, same context per
sequence; llama-server with a slot per stream of the highest concurrency and its prompt
cache on) and drives both with the same light load generator (``serving_client``:
AIPerf's metric definitions, one asyncio process, its own CPU time reported):

- ``concurrency``: synthetic chat, input 128 and 512 tokens, output 128 (``ignore_eos``),
  streaming, at concurrency 1, 4, 16, 32;
- ``rate``: a Poisson request-rate sweep around the first server's saturation rate
  (its request rate at the highest concurrency), goodput under TTFT <= 2 s, ITL <= 100 ms;
- ``cancel``: the same rates with 20% of requests cancelled 1 s after sending;
- ``goodput``: goodput as the field compares servers (DistServe): the highest Poisson
  request rate, 20% cancelled 1 s after sending, at which at least 90% of the requests
  not cancelled meet both SLOs, found per server by stepping and bisecting the rate
  (``serving_goodput``, ``serving_goodput_runs``), with the ratio of the two;
- ``multiturn``: conversations where every second answer is cut off by the client and
  the next turn continues from the partial answer: TTFT and cached prompt share of
  continued turns;
- ``aiperf``: AIPerf itself (its own virtualenv, made here; a tokenizer folder written
  from the model, no network) at one light workload against bargein, beside this
  client at the same workload, with both clients' CPU time (``serving_aiperf``).

bargein's own server overhead comes from its ``/metrics``: the time from the engine
thread emitting a token delta to the server having written its SSE bytes
(``bargein_output_send_delay_seconds``), p50/p99 per concurrency.

Prints tables and one JSON object (last line); ``--plots DIR`` writes PNG charts
(matplotlib: ``pip install matplotlib``, or ``.venv/bin/pip install -e '.[bench]'``).

    .venv/bin/python bench/bench_serving.py [--quick] [--json out.json] [--plots docs/]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import emit, format_table, histogram_quantile, machine_info, rnd  # noqa: E402
from serving_client import Target, run_concurrency, run_conversations, run_rate  # noqa: E402
from serving_goodput import SearchPlan, Slo, ratio_bounds  # noqa: E402
from serving_goodput_runs import GoodputLoad, goodput_sections, measure_goodput  # noqa: E402
from serving_metrics import summarize, summarize_conversations  # noqa: E402
from serving_servers import Server, bargein_server, find_llama_server, llama_server  # noqa: E402
from serving_workloads import PromptMaker  # noqa: E402

SEND_DELAY = "bargein_output_send_delay_seconds"
WORKLOADS = ("concurrency", "rate", "cancel", "goodput", "multiturn", "aiperf")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--threads", type=int, default=2, help="threads of each server (default 2)")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: $LLAMA_SERVER, PATH, "
                   "../llamacpp/build/bin)")
    p.add_argument("--servers", default="bargein,llama-server")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"any of {','.join(WORKLOADS)}")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--input-tokens", default="128,512")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per concurrency level = "
                   "max(4, this x concurrency)")
    p.add_argument("--rates", default="0.5,1.0,1.5", help="request rates as fractions of the first server's "
                   "saturation rate")
    p.add_argument("--rate-requests", type=int, default=24)
    p.add_argument("--cancel-share", type=float, default=0.2)
    p.add_argument("--cancel-after", type=float, default=1.0)
    g = p.add_argument_group("goodput", "the highest rate meeting the SLO share (--workloads goodput)")
    g.add_argument("--goodput-share", type=float, default=0.9, help="share of the requests not cancelled that "
                   "must meet both SLOs (default 0.9)")
    g.add_argument("--goodput-start", type=float, default=1.0, help="the first run's requests/s")
    g.add_argument("--goodput-factor", type=float, default=2.0, help="step the rate by this until a miss")
    g.add_argument("--goodput-resolution", type=float, default=1.2, help="bisect until the failing rate is "
                   "within this factor of the sustained one")
    g.add_argument("--goodput-repeats", type=int, default=2, help="runs of the boundary rate")
    g.add_argument("--goodput-window", type=float, default=20.0, help="seconds of arrivals per run")
    g.add_argument("--goodput-min-requests", type=int, default=13, help="requests per run at least (13: "
                   "10 judged, so that 90%% lets one miss)")
    g.add_argument("--goodput-max-runs", type=int, default=10, help="runs per server at most")
    g.add_argument("--goodput-budget", type=float, default=190.0, help="seconds of the search per server: a "
                   "run starts only if its arrivals and the longest wait for its last request still fit")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--cut-after", type=int, default=24, help="content events before a cut-off answer is cut")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: concurrency 1,8; input 128; few requests")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plots", metavar="DIR", help="write serving_*.png charts into DIR")
    args = p.parse_args()
    if args.quick:
        args.concurrency, args.input_tokens, args.output_tokens = "1,8", "128", 32
        args.rate_requests, args.conversations, args.turns, args.cut_after = 8, 2, 4, 8
        args.rates = "1.0"
        args.goodput_window, args.goodput_budget, args.goodput_max_runs = 5.0, 30.0, 3
        args.goodput_min_requests = 5
    return args


def model_path(ref: str | None) -> Path:
    from bargein.loader.source import default_model_source, resolve_model_ref

    source = default_model_source() if ref is None else resolve_model_ref(ref)
    if source.kind != "gguf":
        raise SystemExit("bench_serving needs a GGUF file: llama-server reads nothing else")
    return Path(source.path)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


class Bench:
    def __init__(self, args: argparse.Namespace, model: Path):
        from bargein.loader import load_tokenizer
        from bargein.loader.source import resolve_model_ref

        self.args, self.model = args, model
        self.tokenizer = load_tokenizer(resolve_model_ref(str(model)))
        self.maker = PromptMaker.for_tokenizer(self.tokenizer)
        self.slo = Slo()
        self.concurrency = ints(args.concurrency)
        self.input_tokens = ints(args.input_tokens)
        self.context = max(self.input_tokens) + 4 * args.output_tokens + args.turns * (64 + args.output_tokens) + 256
        self.saturation: float | None = None  # requests/s of the first server at its highest concurrency
        self.goodput_load = GoodputLoad(min(self.input_tokens), args.output_tokens, args.cancel_share,
                                        args.cancel_after, args.goodput_window, args.goodput_min_requests,
                                        args.goodput_budget, args.seed)
        self.goodput_plan = SearchPlan(args.goodput_start, args.goodput_factor, args.goodput_resolution,
                                       args.goodput_repeats, max_runs=args.goodput_max_runs,
                                       share=args.goodput_share)

    def server(self, name: str) -> Server:
        slots = max(self.concurrency + [self.args.conversations])
        if name == "bargein":
            return bargein_server(self.model, self.args.threads, self.context, slots,
                                  ["--kv-tokens", str(self.context * slots)])
        binary = find_llama_server(self.args.llama_server)
        if binary is None:
            raise SystemExit("llama-server not found: build it with ../shared/tools/build_llamacpp_all.sh "
                             "and pass --llama-server PATH (or drop it with --servers bargein)")
        return llama_server(binary, self.model, self.args.threads, self.context, slots)

    def run(self, server: Server, workloads: set[str]) -> dict[str, Any]:
        target = Target("127.0.0.1", server.port, "m")
        out: dict[str, Any] = {}
        asyncio.run(run_concurrency(target, self.maker.prompts(2, 32, 99), 2, 8))  # warm-up
        if "concurrency" in workloads:
            out["concurrency"] = [self._measured(server, target, isl, c)
                                  for isl in self.input_tokens for c in self.concurrency]
            if self.saturation is None:
                top = [r for r in out["concurrency"] if r["concurrency"] == max(self.concurrency)
                       and r["input_tokens"] == min(self.input_tokens)]
                self.saturation = top[0]["request_s"] if top else None
        rates = [f * (self.saturation or 1.0) for f in map(float, self.args.rates.split(","))]
        for name, share in (("rate", 0.0), ("cancel", self.args.cancel_share)):
            if name in workloads:
                out[name] = [self._rated(server, target, rate, share) for rate in rates]
        if "goodput" in workloads:
            out["goodput"] = measure_goodput(server, target, self.maker, self.goodput_load, self.goodput_plan,
                                             self.slo)
        if "multiturn" in workloads:
            conv = self.maker.conversations(self.args.conversations, self.args.turns, 48, self.args.seed)
            run = asyncio.run(run_conversations(target, conv, self.args.output_tokens, self.args.cut_after))
            out["multiturn"] = summarize_conversations(run)
        return out

    def _measured(self, server: Server, target: Target, isl: int, c: int) -> dict[str, Any]:
        n = max(4, self.args.requests_per_stream * c)
        prompts = self.maker.prompts(n, isl, self.args.seed)
        before, cpu0 = self._scrape(server), server.cpu_seconds()
        run = asyncio.run(run_concurrency(target, prompts, c, self.args.output_tokens))
        after, cpu1 = self._scrape(server), server.cpu_seconds()
        row = {"input_tokens": isl, "concurrency": c, **summarize(run, self.slo),
               "server_cpu_share": (cpu1 - cpu0) / run.duration}
        if before and after:
            row["send_delay_ms"] = {"p50": 1000 * histogram_quantile(before, after, SEND_DELAY, 0.5),
                                    "p99": 1000 * histogram_quantile(before, after, SEND_DELAY, 0.99)}
        return row

    def _rated(self, server: Server, target: Target, rate: float, share: float) -> dict[str, Any]:
        prompts = self.maker.prompts(self.args.rate_requests, min(self.input_tokens), self.args.seed + 2)
        cpu0 = server.cpu_seconds()
        run = asyncio.run(run_rate(target, prompts, rate, self.args.output_tokens, cancel_share=share,
                                   cancel_after_s=self.args.cancel_after, seed=self.args.seed))
        return {"rate": rate, "cancel_share": share, **summarize(run, self.slo),
                "server_cpu_share": (server.cpu_seconds() - cpu0) / run.duration}

    @staticmethod
    def _scrape(server: Server) -> str | None:
        if server.name != "bargein":
            return None
        return server.metrics_text()


def tables(results: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    sections = []
    conc = [{"server": s, "isl": r["input_tokens"], "conc": r["concurrency"], "out tok/s": r["output_tok_s"],
             "TTFT p50 ms": r["ttft_ms"]["p50"], "TTFT p99 ms": r["ttft_ms"]["p99"], "ITL p50 ms": r["itl_ms"]["p50"],
             "ITL p99 ms": r["itl_ms"]["p99"], "client cpu": r["client_cpu_share"], "server cpu": r["server_cpu_share"],
             "send p50 ms": r.get("send_delay_ms", {}).get("p50"), "send p99 ms": r.get("send_delay_ms", {}).get("p99"),
             "errors": r["errors"]}
            for s, res in results.items() for r in res.get("concurrency", [])]
    if conc:
        sections.append(("Concurrency sweep (streaming chat, output 128)", format_table(rnd(conc, 1))))
    for name, title in (("rate", "Poisson request rate"), ("cancel", "Poisson request rate, 20% cancelled after 1 s")):
        rows = [{"server": s, "rate/s": r["rate"], "completed": r["completed"], "cancelled": r["cancelled"],
                 "out tok/s": r["output_tok_s"], "goodput req/s": r["goodput_request_s"],
                 "TTFT p50 ms": r["ttft_ms"]["p50"], "TTFT p99 ms": r["ttft_ms"]["p99"],
                 "ITL p50 ms": r["itl_ms"]["p50"], "errors": r["errors"]}
                for s, res in results.items() for r in res.get(name, [])]
        if rows:
            sections.append((title, format_table(rnd(rows, 2))))
    sections += goodput_sections(results)
    mt = [{"server": s, "turns": res["multiturn"][k]["turns"], "kind": k,
           "TTFT p50 ms": res["multiturn"][k]["ttft_ms"]["p50"], "TTFT p99 ms": res["multiturn"][k]["ttft_ms"]["p99"],
           "cached share p50": res["multiturn"][k]["cached_share_p50"],
           "prompt tokens p50": res["multiturn"][k]["prompt_tokens_p50"]}
          for s, res in results.items() if "multiturn" in res for k in ("continued", "other_later")]
    if mt:
        sections.append(("Multi-turn: turns after a cut-off answer vs other later turns", format_table(rnd(mt, 2))))
    return sections


def main() -> None:
    args = parse_args()
    model = model_path(args.model)
    workloads = set(args.workloads.split(","))
    bench = Bench(args, model)
    results: dict[str, dict[str, Any]] = {}
    for name in args.servers.split(","):
        server = bench.server(name).start()
        try:
            results[name] = bench.run(server, workloads)
            if name == "bargein" and "aiperf" in workloads:
                from serving_aiperf import cross_check

                results[name]["aiperf"] = cross_check(server, bench, Path(os.environ.get(
                    "AIPERF_VENV", Path(__file__).resolve().parent / ".aiperf-venv")))
        finally:
            server.stop()
    sections = tables(results)
    for name, res in results.items():
        if "aiperf" in res:
            sections.append((f"AIPerf vs this client on {name}", res["aiperf"]["table"]))
    result = {"machine": machine_info(), "model": str(model), "threads": args.threads, "slo": vars(bench.slo),
              "saturation_request_s": bench.saturation, "results": results}
    goodputs = [res["goodput"] for res in results.values() if "goodput" in res]
    if len(goodputs) == 2:
        result["goodput_ratio"] = dict(zip(("ratio", "lowest", "highest"), ratio_bounds(*goodputs), strict=True))
    emit("Serving: bargein serve vs llama-server", sections, result, args.json)
    if args.plots:
        from serving_plots import plot

        for path in plot(results, Path(args.plots)):
            print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
