"""Charts of the serving benchmark (matplotlib, PNG): both servers on one chart each."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(results: dict[str, dict[str, Any]], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    rows = {s: r.get("concurrency", []) for s, r in results.items()}
    lengths = sorted({r["input_tokens"] for rs in rows.values() for r in rs})
    if lengths:
        fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4), squeeze=False)
        for ax, isl in zip(axes[0], lengths, strict=True):
            for server, rs in rows.items():
                pts = [(r["concurrency"], r["output_tok_s"]) for r in rs if r["input_tokens"] == isl]
                ax.plot(*zip(*pts, strict=True), marker="o", label=server)
            ax.set(title=f"input {isl}, output 128 tokens", xlabel="concurrency", ylabel="output tokens/s")
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend()
        written.append(_save(fig, folder / "serving_throughput.png"))
    for kind, title in (("rate", "Poisson arrivals"), ("cancel", "Poisson arrivals, 20% cancelled after 1 s")):
        series = {s: r.get(kind, []) for s, r in results.items() if r.get(kind)}
        if not series:
            continue
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for server, rs in series.items():
            rates = [r["rate"] for r in rs]
            for pct, style in (("p50", "-"), ("p99", "--")):
                ax1.plot(rates, [r["ttft_ms"][pct] for r in rs], style, marker="o", label=f"{server} {pct}")
                ax2.plot(rates, [r["itl_ms"][pct] for r in rs], style, marker="o", label=f"{server} {pct}")
        ax1.set(title=f"TTFT, {title}", xlabel="requests/s", ylabel="ms")
        ax2.set(title=f"ITL, {title}", xlabel="requests/s", ylabel="ms")
        for ax in (ax1, ax2):
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        written.append(_save(fig, folder / f"serving_{kind}.png"))
    found = {s: r["goodput"] for s, r in results.items() if r.get("goodput", {}).get("runs_detail")}
    if found:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for server, g in found.items():
            runs = sorted(g["runs_detail"], key=lambda r: r["rate"])
            line = ax.plot([r["rate"] for r in runs], [r["share"] for r in runs], marker="o", label=server)[0]
            if g["max_slo_rate"]:
                ax.axvline(g["max_slo_rate"], color=line.get_color(), linestyle=":", alpha=0.7)
        first = next(iter(found.values()))
        share, load = first["plan"]["share"], first["load"]
        ax.axhline(share, color="grey", linestyle="--", label=f"{share:.0%} of requests")
        ax.set(title=f"Requests within the SLOs, {load['cancel_share']:.0%} cancelled after "
                     f"{load['cancel_after_s']:g} s (dotted: goodput)", xlabel="offered requests/s",
               ylabel="share of the requests not cancelled", ylim=(0, 1.05))
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        written.append(_save(fig, folder / "serving_goodput.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
