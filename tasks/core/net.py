"""Small networking helpers shared by launchers, benchmarks and tests."""
from __future__ import annotations

import random
import socket


_ports_handed_out: set[int] = set()  # ports this process handed out: a caller often takes several before binding any


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


# below the kernel's ephemeral range (where every outgoing connection takes its local port, so a
# port chosen there can be taken before its service binds it) and above Ray's worker ports (10002-19999)
_CHOSEN_PORTS = (20000, 32768)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free at `host` now (nothing holds it for the caller), never one this process
    returned before. Taken below the ephemeral range when there is room, so the outgoing
    connections of other processes do not take it before the caller binds it."""
    low, high = _CHOSEN_PORTS[0], min(_CHOSEN_PORTS[1], _ephemeral_range()[0])
    for _ in range(200 if high - low > 1000 else 0):
        port = random.randrange(low, high)
        if port in _ports_handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _ports_handed_out.add(port)
        return port
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
