"""Ollama's API (``/api/chat``, ``/api/generate`` and the model lists), for the clients
built on it: ``request.py`` translates bodies, ``shape.py`` writes the NDJSON answers,
``routes.py`` holds the routes."""
