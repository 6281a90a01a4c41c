"""The body of ``GET /v1/cluster``: where the model runs, with the engine's recovery counts."""

from __future__ import annotations

from typing import Any


def cluster_snapshot(engine: Any) -> dict[str, Any]:
    """The runner's cluster info, with the engine's count of tokens recomputed after a
    lost stage. Any thread: a pipeline's stages answer on their own threads; this may
    block for a stage that does not answer, so call it off the event loop."""
    info = engine.runner.cluster_info()
    if info.get("pipeline"):
        info["recovery"] = info.get("recovery", {}) | {"kv_losses": engine.counters.kv_losses,
                                                        "tokens_recomputed": engine.counters.recomputed_tokens}
    return info
