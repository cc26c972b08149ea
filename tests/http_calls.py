"""One raw HTTP call against a server under test (the hardening tests send malformed bodies
that no client library would)."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse


def call(url: str, method: str, path: str, body=None, headers=None, timeout: float = 120) -> tuple[int, object]:
    """One HTTP call; ``body`` is JSON-encoded unless it is bytes. Returns (status, JSON or text)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    data = body if isinstance(body, (bytes, bytearray)) or body is None else json.dumps(body).encode()
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        text = r.read().decode()
    finally:
        conn.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text
