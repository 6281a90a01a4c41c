"""ServerSettings: how the HTTP server behaves, from CLI flags and ``BARGEIN_*`` variables.

Settings are frozen: nothing writes them back at run time. ``from_env`` reads the
environment; the CLI uses those values as its flags' defaults, so a flag wins over a
variable, which wins over the built-in default.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from bargein.server.tenants import KeyFileError, KeyTable, TenantKey

ENV_PREFIX = "BARGEIN_"
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
               "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


# The per-request caps: setting name -> what it limits (the CLI's --max-... flags and the README).
LIMIT_FLAGS = {
    "max_messages": "chat messages or Responses input items in one request",
    "max_stop": "stop strings in one request",
    "max_stop_chars": "characters in one stop string",
    "max_logit_bias": "logit_bias entries in one request",
    "max_n": "choices (n) in one request",
}


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")  # what a Host header may name by default (auth.py)
DEFAULT_TENANT = "default"  # the tenant of --api-key / $BARGEIN_API_KEY


class SettingsError(ValueError):
    """A setting a user gave cannot be used; the message names it."""


@dataclass(frozen=True)
class ServerSettings:
    """Everything the HTTP layer needs; the engine's own config is separate (EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)  # one key: tenant DEFAULT_TENANT
    api_keys: tuple[TenantKey, ...] = ()  # --api-keys FILE: one key per tenant line
    # Names the Host header may carry (see auth.py); None: any (an app built in process; the
    # CLI always gives names: LOOPBACK_HOSTS and the --host address unless told others).
    allowed_hosts: tuple[str, ...] | None = None
    shared_prefix_cache: bool = False  # every tenant reuses every other's prefix-cache entries
    # Per tenant (tenant_gate.py): requests handed to the engine at once; more wait in the
    # tenant's own queue, of at most max_queued_per_tenant (None: only --max-queue bounds it);
    # beyond both, 429 naming the limit.
    max_in_flight_per_tenant: int | None = None
    max_queued_per_tenant: int | None = None
    operator_tenants: tuple[str, ...] = ()  # tenants whose keys read every tenant's series in /metrics
    max_tenant_series: int = 64  # tenants with their own /metrics series; the rest share "_other"
    request_timeout: float | None = None  # seconds; a deadline for every request
    max_queue: int | None = None  # live requests at most; more get 429
    max_body_bytes: int = 4 * 1024**2
    max_stored_responses: int = 1000  # Responses API objects kept (LRU)
    debug_endpoints: bool = False  # /debug/kv: block accounting, for tests
    shutdown_timeout: float = 10.0  # seconds to answer in-flight requests on SIGINT/SIGTERM
    log_level: str = "info"
    default_max_tokens: int | None = None  # for chat and responses requests that give none
    max_tokens_limit: int | None = None  # a request asking for more gets 400; caps the defaults
    continuation_memory_entries: int = 256  # answers remembered for token-exact continuation
    continuation_memory_tokens: int = 262_144  # total token ids those answers may hold
    tokenizer_threads: int = 2  # the pool that renders and tokenizes off the event loop
    # Slow clients: a connection must deliver a request's headers, and then its body, in time.
    header_timeout: float = 10.0  # seconds from a request's first byte to its last header (408)
    body_timeout: float = 30.0  # seconds from the headers to the body's last byte (408)
    # Per-request input caps (400 naming the field; see limits.py), checked before any tokenizing.
    max_messages: int = 2048  # chat messages / Responses input items
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 256  # characters in one stop string
    max_logit_bias: int = 1024  # logit_bias entries
    max_n: int = 16  # choices (n)
    reasoning_format: str = "separate"  # thinking models' thoughts: "separate" (reasoning_content) or "none"
    # Backpressure (issue 34): a stream whose client stops reading pauses its generation once
    # about this many tokens wait unsent (in the engine's stream and in the job's buffer, each
    # bounded by it), and is cancelled (reason ``disconnect``) after this many seconds without a read.
    stream_buffer_tokens: int = 64
    stream_stall_timeout: float = 30.0
    # A stream that sent nothing for this many seconds (a long prefill, a read from the disk
    # tier) sends an SSE comment with the prompt's progress (keepalive.py); 0: never.
    sse_keepalive_s: float = 15.0
    # A background Responses request that gives no max_output_tokens generates at most this
    # many (else it could run to the end of the context, holding a slot of the queue limit).
    background_max_output_tokens: int = 1024

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port must be in 0..65535, got {self.port}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise SettingsError(f"request timeout must be positive, got {self.request_timeout}")
        if self.max_queue is not None and self.max_queue < 1:
            raise SettingsError(f"max queue must be at least 1, got {self.max_queue}")
        if self.max_in_flight_per_tenant is not None and self.max_in_flight_per_tenant < 1:
            raise SettingsError(f"max in flight per tenant must be at least 1, got {self.max_in_flight_per_tenant}")
        if self.max_queued_per_tenant is not None:
            if self.max_queued_per_tenant < 0:
                raise SettingsError(f"max queued per tenant must not be negative, got {self.max_queued_per_tenant}")
            if self.max_in_flight_per_tenant is None:
                raise SettingsError("max queued per tenant needs max in flight per tenant: a tenant's requests "
                                    "queue only behind its limit in flight")
        if self.max_tenant_series < 0:
            raise SettingsError(f"max tenant series must not be negative, got {self.max_tenant_series}")
        if self.api_key is not None and len(self.api_key) < 1:
            raise SettingsError("the API key must not be empty")
        try:
            self.key_table()
        except KeyFileError as exc:
            raise SettingsError(str(exc)) from None
        unknown = sorted(set(self.operator_tenants) - self.key_table().tenants)
        if unknown:
            raise SettingsError(f"operator tenants {', '.join(unknown)} have no API key (name tenants of the "
                                f"keys file, or 'default' for --api-key)")
        if self.max_body_bytes < 1024:
            raise SettingsError(f"max body size must be at least 1 KiB, got {self.max_body_bytes}")
        if self.max_stored_responses < 1:
            raise SettingsError("max stored responses must be at least 1")
        for name in ("default_max_tokens", "max_tokens_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SettingsError(f"{name.replace('_', ' ')} must be at least 1, got {value}")
        if (self.default_max_tokens is not None and self.max_tokens_limit is not None
                and self.default_max_tokens > self.max_tokens_limit):
            raise SettingsError(f"default max tokens ({self.default_max_tokens}) is above the max tokens "
                                f"limit ({self.max_tokens_limit})")
        if self.continuation_memory_entries < 0 or self.continuation_memory_tokens < 0:
            raise SettingsError("continuation memory bounds must not be negative")
        if self.tokenizer_threads < 1:
            raise SettingsError(f"tokenizer threads must be at least 1, got {self.tokenizer_threads}")
        for name in ("stream_buffer_tokens", "background_max_output_tokens"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}")
        for name in ("header_timeout", "body_timeout", "stream_stall_timeout"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name.replace('_', ' ')} must be positive, got {getattr(self, name)}")
        if not self.sse_keepalive_s >= 0:
            raise SettingsError(f"the SSE keep-alive interval must not be negative, got {self.sse_keepalive_s}")
        if self.reasoning_format not in ("none", "separate"):
            raise SettingsError(f"reasoning format must be 'none' or 'separate', got {self.reasoning_format!r}")
        for name in ("max_messages", "max_stop", "max_stop_chars", "max_logit_bias", "max_n"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}")

    def key_table(self) -> KeyTable:
        """Every key the server accepts, with its tenant (``api_key`` is DEFAULT_TENANT's)."""
        single = (TenantKey(self.api_key, DEFAULT_TENANT),) if self.api_key else ()
        return KeyTable(single + self.api_keys)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerSettings:
        """Settings from ``BARGEIN_*`` variables, built-in defaults for the rest."""
        env = EnvReader(os.environ if environ is None else environ)
        defaults = cls()
        return cls(
            host=env.str("HOST", defaults.host),
            port=env.int("PORT", defaults.port),
            api_key=env.str("API_KEY", None) or None,
            allowed_hosts=tuple(h for h in (env.str("ALLOWED_HOSTS", "") or "").split(",") if h.strip()) or None,
            shared_prefix_cache=env.bool("SHARED_PREFIX_CACHE", False),
            max_in_flight_per_tenant=env.int("MAX_IN_FLIGHT_PER_TENANT", None),
            max_queued_per_tenant=env.int("MAX_QUEUED_PER_TENANT", None),
            max_tenant_series=env.int("MAX_TENANT_SERIES", defaults.max_tenant_series),
            request_timeout=env.float("REQUEST_TIMEOUT", None),
            max_queue=env.int("MAX_QUEUE", None),
            max_body_bytes=env.size("MAX_BODY", defaults.max_body_bytes),
            max_stored_responses=env.int("MAX_STORED_RESPONSES", defaults.max_stored_responses),
            debug_endpoints=env.bool("DEBUG_ENDPOINTS", False),
            shutdown_timeout=env.float("SHUTDOWN_TIMEOUT", defaults.shutdown_timeout) or 0.0,
            log_level=env.str("LOG_LEVEL", defaults.log_level) or defaults.log_level,
            reasoning_format=env.str("REASONING_FORMAT", defaults.reasoning_format) or defaults.reasoning_format,
            default_max_tokens=env.int("DEFAULT_MAX_TOKENS", None),
            max_tokens_limit=env.int("MAX_TOKENS_LIMIT", None),
            continuation_memory_entries=env.int("CONTINUATION_MEMORY_ENTRIES",
                                                defaults.continuation_memory_entries),
            continuation_memory_tokens=env.int("CONTINUATION_MEMORY_TOKENS", defaults.continuation_memory_tokens),
            tokenizer_threads=env.int("TOKENIZER_THREADS", defaults.tokenizer_threads),
            header_timeout=env.float("HEADER_TIMEOUT", defaults.header_timeout),
            body_timeout=env.float("BODY_TIMEOUT", defaults.body_timeout),
            stream_buffer_tokens=env.int("STREAM_BUFFER_TOKENS", defaults.stream_buffer_tokens),
            stream_stall_timeout=env.float("STREAM_STALL_TIMEOUT", defaults.stream_stall_timeout),
            sse_keepalive_s=env.float("SSE_KEEPALIVE", defaults.sse_keepalive_s),
            background_max_output_tokens=env.int("BACKGROUND_MAX_OUTPUT_TOKENS",
                                                 defaults.background_max_output_tokens),
            **{name: env.int(name.upper(), getattr(defaults, name)) for name in LIMIT_FLAGS},
        )


class EnvReader:
    """Typed reads of ``BARGEIN_<NAME>``; a malformed value is a SettingsError naming it."""

    def __init__(self, environ: Mapping[str, str]):
        self.environ = environ

    def _raw(self, name: str) -> str | None:
        value = self.environ.get(ENV_PREFIX + name)
        return None if value is None or value.strip() == "" else value.strip()

    def _parse(self, name: str, default, parse):
        raw = self._raw(name)
        if raw is None:
            return default
        try:
            return parse(raw)
        except ValueError as exc:
            raise SettingsError(f"{ENV_PREFIX}{name}={raw!r}: {exc}") from None

    def str(self, name: str, default: str | None) -> str | None:
        return self._parse(name, default, lambda s: s)

    def int(self, name: str, default: int | None) -> int | None:
        return self._parse(name, default, int)

    def float(self, name: str, default: float | None) -> float | None:
        return self._parse(name, default, float)

    def size(self, name: str, default: int | None) -> int | None:
        return self._parse(name, default, parse_size)

    def bool(self, name: str, default: bool) -> bool:
        return self._parse(name, default, parse_bool)


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"4 MB"``, ``"1g"`` or a plain byte count, as bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (try 512MiB, 4MB or a byte count)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")
