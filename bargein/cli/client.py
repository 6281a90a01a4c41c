"""A small HTTP client for a bargein server, for the CLI: stream an answer, list, cancel.

Every failure a user can cause (a bad URL, a server that is down, a wrong API key, an
unknown request id) is a :class:`ClientError` with a one-line message; the CLI prints it
and exits non-zero. Nothing here imports the engine.

    client = BargeinClient("http://127.0.0.1:8000")
    async for event in client.stream_chat(messages, max_tokens=64, request_id="mine"):
        print(event.delta, end="")
    client.cancel("mine")          # from anywhere; the stream then ends "cancelled"
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from bargein.cli.common import DEFAULT_URL as DEFAULT_URL
from bargein.cli.common import default_api_key as default_api_key
from bargein.cli.common import default_url as default_url
from bargein.cli.common import server_root as server_root
from bargein.cli.errors import ClientError as ClientError

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0  # a long prompt on a slow machine may take minutes before its first token


class UnknownRequest(ClientError):
    """The server knows no request with this id."""

    def __init__(self, request_id: str):
        super().__init__(f"no request with id {request_id!r} on the server")
        self.request_id = request_id


@dataclass(frozen=True)
class StreamEvent:
    """One piece of a streamed answer: text, and on the last pieces the finish reason and usage."""

    delta: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


class BargeinClient:
    def __init__(self, base_url: str | None = None, api_key: str | None = None):
        self.base_url = server_root(base_url or default_url())
        if not self.base_url.startswith(("http://", "https://")):
            raise ClientError(f"bad URL {self.base_url!r}: give one like {DEFAULT_URL}")
        self.api_key = api_key or None
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)

    # -- plain calls ----------------------------------------------------------------
    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = httpx.request(method, self.base_url + path, headers=self.headers,
                                     timeout=self.timeout, **kwargs)
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from None
        return response

    def model_name(self) -> str:
        response = self._call("GET", "/v1/models")
        self._check(response)
        data = self._json(response, "data") or [{}]
        return str(data[0].get("id", "unknown model"))

    def list_requests(self) -> list[dict[str, Any]]:
        """``GET /v1/requests``: the server's live requests, oldest first."""
        response = self._call("GET", "/v1/requests")
        self._check(response)
        return list(self._json(response, "data"))

    def cancel(self, request_id: str) -> str:
        """Cancels one request; returns "cancelled" or "already_finished", raises UnknownRequest."""
        response = self._call("POST", f"/v1/requests/{request_id}/cancel")
        if response.status_code == 404:
            raise UnknownRequest(request_id)
        self._check(response)
        return str(self._json(response, "status"))

    def cancel_all(self) -> list[str]:
        """Cancels everything in flight; returns the ids that were cancelled."""
        response = self._call("POST", "/v1/requests/cancel", json={"all": True})
        self._check(response)
        return list(self._json(response, "cancelled"))

    async def aprompt_progress(self, request_id: str) -> tuple[int, int] | None:
        """``(prompt_computed, prompt_tokens)`` of a request in flight, from ``GET /v1/requests``."""
        async with httpx.AsyncClient(headers=self.headers, timeout=CONNECT_TIMEOUT_S) as http:
            response = await http.get(f"{self.base_url}/v1/requests")
        self._check(response)
        for r in self._json(response, "data"):
            if r.get("id") == request_id:
                return int(r.get("prompt_computed", r["prompt_tokens"])), int(r["prompt_tokens"])
        return None

    async def acancel(self, request_id: str) -> bool:
        """Like ``cancel`` without blocking the event loop; False when the server did not cancel it."""
        try:
            async with httpx.AsyncClient(headers=self.headers, timeout=CONNECT_TIMEOUT_S) as http:
                response = await http.post(f"{self.base_url}/v1/requests/{request_id}/cancel")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    # -- streaming -------------------------------------------------------------------
    async def stream_chat(self, messages: list[dict[str, str]], *, request_id: str,
                          **sampling: Any) -> AsyncIterator[StreamEvent]:
        """Streams ``/v1/chat/completions`` for the whole history ``messages``."""
        body = {"messages": messages, **_present(sampling)}
        async for event in self._stream("/v1/chat/completions", body, request_id, "delta"):
            yield event

    async def stream_completion(self, prompt: str, *, request_id: str, **sampling: Any) -> AsyncIterator[StreamEvent]:
        """Streams ``/v1/completions`` for a raw prompt (no chat template)."""
        body = {"prompt": prompt, **_present(sampling)}
        async for event in self._stream("/v1/completions", body, request_id, "text"):
            yield event

    async def _stream(self, path: str, body: dict[str, Any], request_id: str,
                      text_field: str) -> AsyncIterator[StreamEvent]:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        headers = {**self.headers, "X-Request-Id": request_id}
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as http, \
                    http.stream("POST", self.base_url + path, json=body, headers=headers) as response:
                if response.status_code != 200:
                    await response.aread()
                    self._check(response)
                async for line in response.aiter_lines():
                    event = _parse_sse_line(line, text_field)
                    if event is not None:
                        yield event
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from None

    # -- errors ----------------------------------------------------------------------
    def _check(self, response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        if response.status_code == 401:
            if self.api_key:
                raise ClientError(f"{self.base_url} rejected the API key given (--api-key or BARGEIN_API_KEY); "
                                  "check it against the key the server was started with")
            raise ClientError(f"{self.base_url} wants an API key: give --api-key or set BARGEIN_API_KEY")
        raise ClientError(f"{self.base_url} answered {response.status_code}: {_error_message(response)}")

    def _json(self, response: httpx.Response, key: str) -> Any:
        """``response.json()[key]``, or a ClientError if this is not a bargein server's answer."""
        try:
            return response.json()[key]
        except (ValueError, KeyError, TypeError):
            raise ClientError(f"{self.base_url} did not answer like a bargein server "
                              f"({response.request.method} {response.request.url.path})") from None

    def _transport_error(self, exc: httpx.HTTPError) -> ClientError:
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return ClientError(f"cannot reach a bargein server at {self.base_url} "
                               "(is `bargein serve` running? set --url or BARGEIN_URL)")
        if isinstance(exc, (httpx.InvalidURL, httpx.UnsupportedProtocol)):
            return ClientError(f"bad URL {self.base_url!r}: {exc}")
        return ClientError(f"the connection to {self.base_url} failed: {exc or type(exc).__name__}")


def _present(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):  # not an OpenAI-shaped error: keep it to one line
        return f"{response.reason_phrase or 'error'} (is this a bargein server?)"


def _parse_sse_line(line: str, text_field: str) -> StreamEvent | None:
    """A ``data:`` line of a chat or completion stream as a StreamEvent (None for the rest)."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return None
    chunk = json.loads(payload)
    if "error" in chunk:
        raise ClientError(f"the server failed the request: {chunk['error'].get('message', chunk['error'])}")
    if chunk.get("usage"):
        return StreamEvent(usage=chunk["usage"])
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    source = choice.get("delta", {}) if text_field == "delta" else choice
    text = source.get("content" if text_field == "delta" else "text") or ""
    return StreamEvent(delta=text, finish_reason=choice.get("finish_reason"))
