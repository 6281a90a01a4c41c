"""The listening socket, in a module of its own: the CLI binds it before the model loads
(a busy port fails fast) and before it imports the server (FastAPI, uvicorn), which it
does while the model loads."""

from __future__ import annotations

import socket

# The kernel's send buffer of each connection (accepted sockets inherit the listener's; the
# kernel doubles the value). Left to autotuning it grows to megabytes, so a streamed answer
# whose client stopped reading would be generated thousands of tokens ahead before the
# server's own bounded buffer (generation.py) fills and pauses it. 64 KiB still carries
# about 1 MB/s to a client 100 ms away, far more than a token stream needs.
SEND_BUFFER_BYTES = 64 * 1024


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket, bound before the model loads so a busy port fails fast (OSError)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
