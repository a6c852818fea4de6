"""Small networking helpers shared by launchers, benchmarks and tests."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free at `host` now (the OS picks it; nothing holds it for the caller)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
