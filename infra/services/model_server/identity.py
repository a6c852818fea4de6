"""Proof that the process answering on the model server's port is the stack's model server.

The port is only a number: while the supervisor restarts the server, any local process can bind it
and answer `/health` 200. So before the supervisor or the stack's health check trusts a health
answer, or sends the server anything (the clients' key, a reload with the admin key), it sends a
fresh random nonce, `GET /health?challenge=<nonce>`, and the server answers
HMAC-SHA256(admin key, purpose | port | nonce). Only a holder of the admin key (a 0600 secret in the
stack's state directory) can answer; the port is bound in, so another server of the same stack (a
challenger's verification server) cannot be used as an oracle by an impostor relaying the challenge.

`verified_connection` keeps the TCP connection the proof came over (and never reconnects), so what
is sent next goes to the process that proved itself, not to whoever holds the port a moment later.

Standard library only: the stack runs `python -m infra.services.model_server.identity` as the
model server's health probe (infra/stack.py ServiceSpec.probe), many times while it starts.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import http.client
import json
import secrets
import sys
import urllib.parse
from pathlib import Path

PURPOSE = b"crucible-model-server-identity"
NONCE_PATTERN = r"^[A-Za-z0-9_-]{16,128}$"


def proof(admin_key: str, port: int, nonce: str) -> str:
    """The server's answer to a challenge: HMAC(admin key, purpose | port | nonce)."""
    return hmac.new(admin_key.encode(), b"|".join((PURPOSE, str(int(port)).encode(), nonce.encode())),
                    hashlib.sha256).hexdigest()


def verified_connection(host: str, port: int, admin_key: str, timeout: float = 5.0
                        ) -> tuple[http.client.HTTPConnection, dict] | None:
    """(connection, health answer) once the peer proved it holds the admin key; None if it did not
    (the connection is then closed, and nothing else was sent)."""
    nonce = secrets.token_urlsafe(32)
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.connect()
        conn.auto_open = 0  # a dropped connection raises instead of reconnecting to whoever holds the port
        conn.request("GET", "/health?" + urllib.parse.urlencode({"challenge": nonce}))
        resp = conn.getresponse()
        body = resp.read(1 << 16)
        health = json.loads(body) if resp.status == 200 else None
        answer = health.get("identity") if isinstance(health, dict) else None
        if isinstance(answer, str) and hmac.compare_digest(answer.encode(), proof(admin_key, port, nonce).encode()):
            return conn, health
    except (OSError, http.client.HTTPException, ValueError):
        pass
    conn.close()
    return None


def proven(host: str, port: int, admin_key_file: str | Path, timeout: float = 5.0) -> bool:
    """The process on host:port holds the admin key in `admin_key_file`."""
    try:
        key = Path(admin_key_file).read_text().strip()
    except OSError:
        return False
    found = verified_connection(host, port, key, timeout) if key else None
    if found is None:
        return False
    found[0].close()
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.services.model_server.identity",
                                 description="exit 0 if the model server on host:port proves it holds the admin key")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--admin-key-file", required=True)
    ap.add_argument("--timeout", type=float, default=10.0)
    args = ap.parse_args(argv)
    return 0 if proven(args.host, args.port, args.admin_key_file, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
