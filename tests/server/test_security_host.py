"""The host and the page, written as the attacks of issue 34: a foreign ``Host`` (DNS
rebinding) gets 403; a cross-site form POST cannot cancel a request; every response
carries the security headers; the serve flags keep keys out of ``ps``.

A real server on loopback around the tiny engine (``tiny_live_server``), without keys
(the default the probe found open), with the CLI's default host list.
"""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from bargein.cli import serve as serve_cli
from bargein.cli.errors import CliError
from bargein.server.auth import allowed_host_names
from bargein.server.settings import LOOPBACK_HOSTS, ServerSettings
from tests.server.tiny_live_server import tiny_live_server

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with tiny_live_server(allowed_hosts=allowed_host_names((), "127.0.0.1")) as live:
        yield live


def _port(server) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def test_a_foreign_host_gets_403_and_loopback_names_are_served(server):
    port = _port(server)
    for host in ("evil.example", f"evil.example:{port}", "attacker.localhost.evil", "127.0.0.2", "[::2]"):
        for path in ("/health", "/", "/v1/models"):
            r = httpx.get(server.base_url + path, headers={"Host": host}, timeout=30)
            assert r.status_code == 403, (host, path, r.status_code)
            assert r.json()["error"]["code"] == "host_not_allowed"
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST."):
        assert httpx.get(server.base_url + "/v1/models", headers={"Host": host}, timeout=30).status_code == 200


def test_a_cross_site_form_post_cannot_cancel_a_request(server):
    server.step_delay_s = 0.02  # keeps the victim live for 8 s at least
    try:
        rid = "victim-request-1"
        body = {"prompt": "count", "max_tokens": 400, **GREEDY}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**body, "stream": True},
                          headers={"X-Request-Id": rid}, timeout=120) as victim:
            lines = victim.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            url = server.base_url
            attacks = [  # what a page on another site can make a browser send
                ("/v1/requests/cancel", {"Origin": "http://evil.example", "Content-Type":
                                         "application/x-www-form-urlencoded"}, b"all=true"),
                (f"/v1/requests/{rid}/cancel", {"Origin": "http://evil.example", "Content-Type": "text/plain"}, b""),
                (f"/v1/requests/{rid}/cancel", {"Origin": "null"}, b""),  # a sandboxed frame
                ("/v1/chat/cancel", {"Content-Type": "text/plain"}, b'{"request_id": "victim-request-1"}'),
                ("/v1/requests/cancel", {"Content-Type": "multipart/form-data; boundary=x"},
                 b'--x\r\nContent-Disposition: form-data; name="all"\r\n\r\ntrue\r\n--x--\r\n'),
            ]
            for path, headers, content in attacks:
                r = httpx.post(url + path, headers=headers, content=content, timeout=30)
                assert r.status_code in (403, 415), (path, headers, r.status_code, r.text)
                expected = "origin_not_allowed" if "Origin" in headers else "unsupported_media_type"
                assert r.json()["error"]["code"] == expected
            listed = httpx.get(f"{url}/v1/requests", timeout=30).json()["data"]
            assert rid in {item["id"] for item in listed}  # still running
            # the page's own same-origin request (JSON, its Origin) does cancel
            own = httpx.post(f"{url}/v1/requests/{rid}/cancel", json=None, timeout=30,
                             headers={"Origin": url, "Content-Type": "application/json"})
            assert own.status_code == 200 and own.json()["status"] == "cancelled", own.text
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
            assert reasons[-1] == "cancelled", reasons[-3:]
    finally:
        server.step_delay_s = 0.0
    server.wait_idle()


def test_bodies_must_be_json(server):
    url = f"{server.base_url}/v1/completions"
    ok = {"prompt": "hi", "max_tokens": 1}
    assert httpx.post(url, json=ok, timeout=60).status_code == 200
    for content_type in ("application/json; charset=utf-8", "application/merge-patch+json"):
        r = httpx.post(url, content=b'{"prompt": "hi", "max_tokens": 1}', headers={"Content-Type": content_type},
                       timeout=60)
        assert r.status_code == 200, (content_type, r.text)
    for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}):
        r = httpx.post(url, content=b'{"prompt": "hi", "max_tokens": 1}', headers=headers, timeout=60)
        assert r.status_code == 415, (headers, r.text)
    server.wait_idle()


def test_every_response_carries_the_security_headers(server):
    for path in ("/", "/index.html", "/app.js", "/health", "/v1/models", "/v1/nope"):
        r = httpx.get(server.base_url + path, timeout=30)
        csp = r.headers["Content-Security-Policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp, path
        assert "default-src 'self'" in csp and "object-src 'none'" in csp
        assert r.headers["X-Content-Type-Options"] == "nosniff" and r.headers["X-Frame-Options"] == "DENY"
    refused = httpx.get(server.base_url + "/health", headers={"Host": "evil.example"}, timeout=30)
    assert refused.headers["X-Content-Type-Options"] == "nosniff"


def test_allowed_host_names():
    assert allowed_host_names(()) == LOOPBACK_HOSTS
    assert allowed_host_names((), "0.0.0.0") == LOOPBACK_HOSTS  # a wildcard names no host
    assert allowed_host_names((), "::") == LOOPBACK_HOSTS
    assert allowed_host_names((), "192.168.1.5") == (*LOOPBACK_HOSTS, "192.168.1.5")
    assert allowed_host_names(["chat.lan", " Box "], "0.0.0.0") == ("chat.lan", "box")
    assert allowed_host_names(["*"]) == ("*",)


def _serve_args(monkeypatch, argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    for name in ("BARGEIN_API_KEY", "BARGEIN_API_KEY_FILE", "BARGEIN_API_KEYS", "BARGEIN_ALLOWED_HOSTS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    serve_cli._add_serve_arguments(parser)
    return parser.parse_args(argv)


def _access(monkeypatch, argv: list[str], env: dict[str, str] | None = None) -> ServerSettings:
    args = _serve_args(monkeypatch, argv, env)
    return ServerSettings(**serve_cli._access_settings(args))


def test_keys_stay_out_of_the_command_line(monkeypatch, tmp_path, capsys):
    key_file = tmp_path / "key"
    key_file.write_text("\n  from-a-file-0123\n")
    settings = _access(monkeypatch, ["--api-key-file", str(key_file)])
    assert settings.key_table().tenant_for("from-a-file-0123").name == "default"
    settings = _access(monkeypatch, [], {"BARGEIN_API_KEY": "from-the-env-0123"})
    assert settings.key_table().tenant_for("from-the-env-0123") is not None
    assert capsys.readouterr().err == ""  # neither warns
    settings = _access(monkeypatch, ["--api-key", "on-the-command-line"])
    assert "ps" in capsys.readouterr().err  # this one is visible to every user: a warning says so
    assert "on-the-command-line" not in repr(settings)  # nor is a key ever printed with the settings
    assert settings.allowed_hosts == LOOPBACK_HOSTS


def test_the_keys_file_names_tenants(monkeypatch, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nalice-key-0123456789 alice\n\nalice-phone-0123456 alice\nnameless-key-0123\n")
    table = _access(monkeypatch, ["--api-keys", str(keys), "--allowed-hosts", "chat.lan"]).key_table()
    assert table.tenant_for("alice-phone-0123456").name == "alice"
    assert table.tenant_for("nameless-key-0123").name.startswith("key-")
    assert table.tenant_for("nameless-key-012") is None and table.tenant_for("") is None
    keys.write_text("alice-key-0123456789 alice extra\n")
    with pytest.raises(CliError, match=r"keys:1: expected 'KEY' or 'KEY TENANT'") as error:
        serve_cli._start_serving(_serve_args(monkeypatch, ["--api-keys", str(keys)]))
    assert "alice-key" not in str(error.value)
    keys.write_text("short alice\n")
    with pytest.raises(CliError, match="at least 8 characters"):
        serve_cli._start_serving(_serve_args(monkeypatch, ["--api-keys", str(keys)]))


def test_a_tenant_name_and_salt_never_spell_another_namespace():
    from bargein.server.tenants import Tenant, prefix_namespace

    assert prefix_namespace(Tenant(""), None, shared=False) is None
    assert prefix_namespace(Tenant("a"), None, shared=True) is None
    spelled = {prefix_namespace(Tenant(t), s, shared=False) for t, s in (("ab", "c"), ("a", "bc"), ("abc", None))}
    assert len(spelled) == 3
