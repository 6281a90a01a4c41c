"""Per-request input caps, checked on the parsed body before any tokenizing or engine work.

Each cap bounds a cost that grows with the input: every stop string is matched against
every new piece of text of every request in the batch, every ``logit_bias`` entry is
applied at every step, each message is rendered and tokenized, each of ``n`` choices is a
sequence. The values come from ``ServerSettings`` (``--max-stop`` and friends, see
``settings.LIMIT_FLAGS``); a request over one gets a 400 whose ``param`` names the field.
Ranges of single values (temperature, a bias's size) stay with ``SamplingParams``.
"""

from __future__ import annotations

from typing import Any

from bargein.server.errors import APIError
from bargein.server.settings import ServerSettings


def check_limits(body: Any, settings: ServerSettings) -> None:
    """Raise a 400 ``APIError`` if ``body`` (a chat, completion or response request) is over a cap."""
    messages = getattr(body, "messages", None)
    if messages is not None:
        _at_most("messages", len(messages), settings.max_messages, "messages")
    items = getattr(body, "input", None)
    if isinstance(items, list):
        _at_most("input", len(items), settings.max_messages, "input items")
    stop = getattr(body, "stop", None)
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    _at_most("stop", len(stops), settings.max_stop, "stop strings")
    for i, text in enumerate(stops):
        if len(text) > settings.max_stop_chars:
            raise APIError(400, f"stop[{i}] has {len(text)} characters; at most {settings.max_stop_chars} are allowed",
                           param="stop", code="invalid_value")
    _at_most("logit_bias", len(getattr(body, "logit_bias", None) or ()), settings.max_logit_bias,
             "logit_bias entries")
    n = getattr(body, "n", None)
    if isinstance(n, int):
        _at_most("n", n, settings.max_n, "choices (n)")


def _at_most(param: str, count: int, cap: int, what: str) -> None:
    if count > cap:
        raise APIError(400, f"{param}: {count} {what} is more than this server allows ({cap})",
                       param=param, code="invalid_value")
