"""The Anthropic Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

``request.py`` turns a Messages body into what the one serving path takes (template
messages, a tool plan, sampling parameters); ``shape.py`` is the answer's shape (the
event sequence of a stream, the message body); ``errors.py`` the error shape;
``routes.py`` the routes. Cancel, deadlines, shutdown and token-exact continuation are
those of every other route (``serving.serve``).
"""
