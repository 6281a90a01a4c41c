"""Several machines: one model split into pipeline stages, or whole-engine replicas, on Ray.

Ray is an optional extra (``pip install 'bargein[ray]'``). ``split``, ``widths``,
``weights`` and ``errors`` import no Ray; ``pipeline`` (a :class:`~bargein.engine.runner.Runner`
the engine drives), ``stage`` (what runs in each stage's actor) and ``replicas`` (an
:class:`~bargein.engine.client.EngineClient` over engine replicas) do, when they start
something. The engine never imports this package: ``bargein.build.build_engine`` does,
only when ``EngineConfig.pipeline`` is set.
"""
