"""Tenants: who a request comes from, by the API key it carries.

A server started without keys has one tenant, :data:`ANONYMOUS`, which everyone is. With
keys (``--api-key``, ``--api-key-file``, ``BARGEIN_API_KEY`` or ``--api-keys FILE``) each
key belongs to one named tenant, and a tenant sees and cancels only its own requests and
stored responses, and reuses only prefix-cache entries computed under its own namespace
(unless ``--shared-prefix-cache``).

A keys file has one key per line, optionally followed by whitespace and a tenant name;
blank lines and lines starting with ``#`` are skipped. Several keys may name one tenant
(a user with several clients). A key without a name gets ``key-<8 hex digits>`` from a
hash of the key, so the name is stable across edits of the file and shows nothing of the
key itself. Errors name the file and the line, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

TENANT_NAME = re.compile(r"[A-Za-z0-9._:@-]{1,64}")
MIN_KEY_CHARS = 8  # a shorter key is guessed in a few requests


class KeyFileError(ValueError):
    """A keys file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Tenant:
    """A client identity: ``name`` is what logs and ownership checks use ("" is anonymous)."""

    name: str

    @property
    def is_anonymous(self) -> bool:
        return self.name == ""


ANONYMOUS = Tenant("")


@dataclass(frozen=True)
class TenantKey:
    """One API key and the tenant it belongs to."""

    key: str
    tenant: str

    def __repr__(self) -> str:  # never print a key into a log or a traceback
        return f"TenantKey(tenant={self.tenant!r}, key=<{len(self.key)} chars>)"


def default_tenant_name(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def read_key_file(path: str | Path, *, named: bool) -> tuple[TenantKey, ...]:
    """The keys in ``path``: with ``named``, ``KEY [TENANT]`` lines (``--api-keys``);
    else one key, the file's first non-blank line (``--api-key-file``)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read the API keys file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    keys: list[TenantKey] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        fields = stripped.split()
        if not named:
            if len(fields) != 1:
                raise KeyFileError(f"{path}:{number}: an API key file holds one key (no spaces)")
            return (_checked(fields[0], default_tenant_name(fields[0]), path, number),)
        if len(fields) > 2:
            raise KeyFileError(f"{path}:{number}: expected 'KEY' or 'KEY TENANT', got {len(fields)} fields")
        key = fields[0]
        keys.append(_checked(key, fields[1] if len(fields) == 2 else default_tenant_name(key), path, number))
    if not keys:
        raise KeyFileError(f"{path}: no API key in the file")
    return tuple(keys)


def _checked(key: str, tenant: str, path: str | Path, number: int) -> TenantKey:
    if len(key) < MIN_KEY_CHARS:
        raise KeyFileError(f"{path}:{number}: an API key must have at least {MIN_KEY_CHARS} characters")
    if not key.isascii() or not key.isprintable():
        raise KeyFileError(f"{path}:{number}: an API key must be printable ASCII")
    if not TENANT_NAME.fullmatch(tenant):
        raise KeyFileError(f"{path}:{number}: a tenant name must be 1-64 characters of letters, digits and ._:@-")
    return TenantKey(key, tenant)


class KeyTable:
    """The server's keys; ``tenant_for(token)`` is the one place a key is checked.

    Every configured key is compared in constant time, whichever matches, so the time an
    answer takes says nothing about which key (or how much of one) was right.
    """

    def __init__(self, keys: Iterable[TenantKey]):
        self._keys = tuple((k.key.encode(), Tenant(k.tenant)) for k in keys)
        seen: set[bytes] = set()
        for key, _ in self._keys:
            if key in seen:
                raise KeyFileError("the same API key is given twice")
            seen.add(key)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(t.name for _, t in self._keys)

    def tenant_for(self, token: str) -> Tenant | None:
        """The tenant whose key ``token`` is, or None."""
        given = token.encode("utf-8", "surrogateescape")
        found = None
        for key, tenant in self._keys:
            if hmac.compare_digest(given, key):
                found = tenant
        return found


def prefix_namespace(tenant: Tenant, cache_salt: str | None, *, shared: bool) -> str | None:
    """The prefix-cache namespace of a request: its tenant's (unless the cache is shared)
    and its own ``cache_salt``; None is the common namespace (no keys, no salt).

    Requests reuse K/V only within one namespace, so another tenant's prompt cannot be
    probed through ``cached_tokens``. The parts are length-prefixed, so no tenant name
    and salt can spell another pair's namespace.
    """
    owner = "" if shared else tenant.name
    if not owner and cache_salt is None:
        return None
    salt = "" if cache_salt is None else cache_salt
    return f"{len(owner)}:{owner}{len(salt)}:{salt}"
