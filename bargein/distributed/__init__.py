"""Several machines: one model split into pipeline stages on a Ray cluster.

Ray is an optional extra (``pip install 'bargein[ray]'``). ``split`` and ``weights``
import no Ray; ``pipeline`` (the runner the engine drives) and ``stage`` (what runs
in each stage's actor) do. The engine imports ``pipeline`` only when
``EngineConfig.pipeline`` is set.
"""
