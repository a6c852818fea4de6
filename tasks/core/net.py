"""Small networking helpers shared by launchers, benchmarks and tests."""
from __future__ import annotations

import socket


_ports_handed_out: set[int] = set()  # ports this process handed out: a caller often takes several before binding any


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free at `host` now (the OS picks it; nothing holds it for the caller), never one
    this process returned before."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _ports_handed_out:
            _ports_handed_out.add(port)
            return port


def prefect_api_headers(auth_string: str | None = None) -> dict[str, str]:
    """What a raw HTTP client of a Prefect API with server auth sends: Basic `auth_string` (default:
    this process's PREFECT_API_AUTH_STRING, as Prefect's own clients use); none without one."""
    import base64
    import os

    value = auth_string or os.environ.get("PREFECT_API_AUTH_STRING")
    return {"Authorization": "Basic " + base64.b64encode(value.encode()).decode()} if value else {}
