"""Who may ask what: the one access rule of the server, checked in the middleware before
any route runs.

- **Host and Origin.** A request's ``Host`` must name this server (the loopback names by
  default, ``--allowed-hosts`` to add others or ``*``), so a web page that rebinds its
  DNS name to 127.0.0.1 cannot reach the API (403). A request with an ``Origin`` from
  another site is refused (403): the API serves no cross-origin pages, and a browser
  sends ``Origin`` on every cross-site POST, form or fetch.
- **JSON bodies.** A POST, PUT or PATCH with a body must say it is JSON (415): an HTML
  form can send only urlencoded, multipart or text/plain bodies, so no cross-site form
  reaches a route.
- **The key.** Every path needs a valid key (``Authorization: Bearer KEY`` or Anthropic's
  ``x-api-key: KEY``) except the explicit public list: ``GET /health`` and the chat
  page's own static files, which hold no data. The rule is default-deny by path, so a
  route added later (an alias, another API's routes) is guarded without anyone writing
  it down; tests walk the app's route table to check it. The key names the request's
  tenant (``tenants.py``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from bargein.server.error_shapes import ErrorFamily, error_family
from bargein.server.errors import APIError
from bargein.server.settings import LOOPBACK_HOSTS
from bargein.server.tenants import ANONYMOUS, KeyTable, Tenant

ANY_HOST = "*"
PUBLIC_API_PATHS = frozenset({"/health"})  # outside the chat page's files: open without a key
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})

# Sent with every response. The page loads only its own scripts and styles (no inline
# code, no eval), talks only to this server, and may not be framed (clickjacking).
SECURITY_HEADERS = (
    (b"content-security-policy",
     b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
     b"object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
)


def static_paths(static_dir: Path) -> frozenset[str]:
    """The URL paths of the chat page's files (``/`` and ``/index.html`` included)."""
    if not (static_dir / "index.html").is_file():
        return frozenset()
    files = {"/" + p.relative_to(static_dir).as_posix() for p in static_dir.rglob("*") if p.is_file()}
    return frozenset(files | {"/"})


def host_name(value: str) -> str | None:
    """The host of a ``Host`` header or an origin's netloc, lower-cased, without the port;
    None if it is not a host name."""
    try:
        host = urlsplit("//" + value.strip()).hostname
    except ValueError:
        return None
    return host.lower().rstrip(".") if host else None


def allowed_host_names(hosts: Iterable[str], bind_host: str | None = None) -> tuple[str, ...]:
    """The names a Host header may carry: ``hosts`` (the loopback names when empty) plus the
    address the server listens on, unless that is a wildcard (0.0.0.0, ::)."""
    names = [h.strip().lower() for h in hosts if h.strip()] or list(LOOPBACK_HOSTS)
    if bind_host and bind_host not in names and not _is_wildcard(bind_host):
        names.append(bind_host.lower())
    return tuple(dict.fromkeys(n.strip("[]") for n in names))


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def api_token(headers: Mapping[bytes, bytes]) -> str | None:
    """The key a request carries: ``Authorization: Bearer KEY`` or ``x-api-key: KEY``."""
    given = headers.get(b"authorization", b"").decode("latin-1")
    if given[:7].lower() == "bearer ":
        return given[7:].strip() or None
    return headers.get(b"x-api-key", b"").decode("latin-1").strip() or None


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


@dataclass(frozen=True)
class AccessRule:
    """The server's access rule: keys, public paths and allowed hosts (None: any Host)."""

    keys: KeyTable
    public_paths: frozenset[str]
    allowed_hosts: tuple[str, ...] | None

    def is_public(self, method: str, path: str) -> bool:
        """Open without a key: GET or HEAD of /health or of one of the chat page's files."""
        return method in ("GET", "HEAD") and (path in PUBLIC_API_PATHS or path in self.public_paths)

    def origin_error(self, headers: Mapping[bytes, bytes]) -> APIError | None:
        """403 for a Host this server does not answer to, or an Origin of another site."""
        host = headers.get(b"host", b"").decode("latin-1")
        if self.allowed_hosts is not None and ANY_HOST not in self.allowed_hosts:
            name = host_name(host)
            if name is None or name not in self.allowed_hosts:
                return APIError(403, f"this server does not answer to the host {host[:100]!r}; start it with "
                                     f"--allowed-hosts NAME to allow it", code="host_not_allowed")
        origin = headers.get(b"origin")
        if origin is not None:
            parts = urlsplit(origin.decode("latin-1"))
            if parts.scheme not in ("http", "https") or parts.netloc.lower() != host.strip().lower():
                return APIError(403, "cross-origin requests are refused: the API serves its own page only",
                                code="origin_not_allowed")
        return None

    def body_type_error(self, method: str, headers: Mapping[bytes, bytes], has_body: bool) -> APIError | None:
        """415 for a request body that is not declared JSON."""
        if method not in BODY_METHODS:
            return None
        content_type = headers.get(b"content-type")
        if content_type is None and not has_body:
            return None  # a bare POST (a cancel by path): nothing for a form to smuggle
        if content_type is None or not is_json(content_type.decode("latin-1")):
            return APIError(415, "request bodies must be JSON: send 'Content-Type: application/json'",
                            code="unsupported_media_type")
        return None

    def tenant(self, method: str, path: str, headers: Mapping[bytes, bytes]) -> tuple[Tenant | None, APIError | None]:
        """The request's tenant, or the 401 to answer. Public paths and key-less servers
        are :data:`ANONYMOUS`; a valid key on a public path still names its tenant."""
        if not self.keys.enabled:
            return ANONYMOUS, None
        token = api_token(headers)
        tenant = self.keys.tenant_for(token) if token else None
        if tenant is not None:
            return tenant, None
        if self.is_public(method, path):
            return ANONYMOUS, None
        message = "invalid API key" if token else f"missing API key: send {key_header_for(path)}"
        return None, APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def key_header_for(path: str) -> str:
    """How the clients of ``path``'s API send a key (both headers are accepted everywhere):
    Anthropic's SDK sends ``x-api-key``; OpenAI's and Ollama's send a Bearer token."""
    if error_family(path) == ErrorFamily.ANTHROPIC:
        return "'x-api-key: <key>' (or 'Authorization: Bearer <key>')"
    return "'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
