"""One HTTP request to a rollout server, over TCP (``http://host:port``) or a Unix socket (``unix:/path/to.sock``).

Servers the run launches listen on a Unix socket in a directory only the run's user may enter (``launch.py``): no
other local user can open a connection to them, so none can hold the server's connections open or exhaust its file
descriptors (the stock server has no timeout for a request whose headers never finish). ``http.client`` speaks
HTTP over any connected socket; only the connection differs.
"""

from __future__ import annotations

import http.client
import socket
from urllib.parse import urlsplit

__all__ = ["UNIX_SCHEME", "is_unix_url", "request", "unix_socket_path"]

UNIX_SCHEME = "unix:"


def is_unix_url(url: str) -> bool:
    return url.startswith(UNIX_SCHEME)


def unix_socket_path(url: str) -> str:
    return url[len(UNIX_SCHEME) :]


class _UnixConnection(http.client.HTTPConnection):
    """``HTTPConnection`` over a Unix socket (the Host header says ``localhost``)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _connection(url: str, timeout: float) -> http.client.HTTPConnection:
    if is_unix_url(url):
        return _UnixConnection(unix_socket_path(url), timeout)
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return kind(parts.hostname or "", parts.port, timeout=timeout)


def request(
    url: str, method: str, path: str, body: bytes | None, headers: dict[str, str], timeout: float
) -> tuple[int, bytes]:
    """``(status, body)`` of ``method path`` on the server at base URL ``url``; raises ``OSError`` (a timeout, a
    refused or reset connection) when no answer came."""
    connection = _connection(url, timeout)
    try:
        connection.request(method, path, body, headers)  # a base URL has no path of its own (ServerConfig.check)
        response = connection.getresponse()
        return response.status, response.read()
    except http.client.HTTPException as error:  # a malformed or cut answer: no answer, as far as the caller goes
        raise ConnectionError(f"{type(error).__name__}: {error}") from None
    finally:
        connection.close()
