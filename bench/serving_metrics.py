"""AIPerf's summary statistics over one load run (definitions in ``serving_client``)."""

from __future__ import annotations

import math
from typing import Any

from common import percentile
from serving_client import Record, Run
from serving_goodput import Slo

DEFAULT_SLO = Slo()


def _pcts(values: list[float], scale: float = 1.0) -> dict[str, float]:
    keys = (("p50", 50), ("p90", 90), ("p99", 99))
    return {k: (percentile(values, p) * scale if values else math.nan) for k, p in keys}


def summarize(run: Run, slo: Slo = DEFAULT_SLO) -> dict[str, Any]:
    """Counts, throughputs and percentiles of one run; latencies in milliseconds."""
    done = run.completed
    duration = run.duration or math.nan
    ttft = [r.ttft for r in done if r.ttft is not None]
    itl = [r.itl for r in done if r.itl is not None]
    latency = [r.latency for r in done if r.latency is not None]
    delivered = sum(r.output_tokens for r in run.records if r.outcome in ("ok", "cancelled", "cut"))
    return {
        "requests": len(run.records),
        "completed": len(done),
        "cancelled": sum(r.outcome == "cancelled" for r in run.records),
        "errors": sum(r.outcome == "error" for r in run.records),
        "stopped": sum(r.outcome == "stopped" for r in run.records),
        "first_error": next((r.error for r in run.records if r.error), None),
        "duration_s": duration,
        "output_tok_s": sum(r.output_tokens for r in done) / duration,
        "delivered_tok_s": delivered / duration,
        "request_s": len(done) / duration,
        "goodput_request_s": sum(slo.met(r) for r in done) / duration,
        "ttft_ms": _pcts(ttft, 1000),
        "itl_ms": _pcts(itl, 1000),
        "latency_ms": _pcts(latency, 1000),
        "client_cpu_s": run.client_cpu_s,
        "client_cpu_share": run.client_cpu_s / duration,
    }


def summarize_conversations(run: Run) -> dict[str, Any]:
    """Multi-turn: TTFT and cached prompt tokens of continued turns (after a cut-off answer)
    against the other turns after the first."""
    later = [r for r in run.records if r.turn > 0 and r.outcome in ("ok", "cut")]
    continued = [r for r in later if r.continued]
    fresh = [r for r in later if not r.continued]

    def part(rs: list[Record]) -> dict[str, Any]:
        cached = [r.cached_tokens / r.prompt_tokens for r in rs if r.cached_tokens is not None and r.prompt_tokens]
        return {"turns": len(rs), "ttft_ms": _pcts([r.ttft for r in rs if r.ttft is not None], 1000),
                "cached_share_p50": percentile(cached, 50) if cached else math.nan,
                "prompt_tokens_p50": percentile([r.prompt_tokens for r in rs if r.prompt_tokens], 50)
                if any(r.prompt_tokens for r in rs) else math.nan}

    return {"continued": part(continued), "other_later": part(fresh),
            "errors": sum(r.outcome == "error" for r in run.records),
            "first_error": next((r.error for r in run.records if r.error), None),
            "client_cpu_s": run.client_cpu_s}
