"""Start the lineage service (infra/services/lineage) as a child process on loopback and wait until
it answers /healthz. Shared by the lineage tests and benchmarks/lineage_service.py, which need a
real server process."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from tasks.core.constants import REPO_ROOT


def start_service(db: str | Path, port: int, load: str | Path | None = None,
                  timeout: float = 30.0, token_file: str | Path | None = None) -> tuple[subprocess.Popen, str]:
    """(process, base URL); raises RuntimeError with the service's output if it does not come up.
    token_file: the write token's file (None: the service refuses writes)."""
    cmd = [sys.executable, "-m", "infra.services.lineage", "--db", str(db), "--host", "127.0.0.1",
           "--port", str(port)] + (["--write-token-file", str(token_file)] if token_file else [])
    if load:
        cmd += ["--load", str(load)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"lineage service did not start: {proc.communicate()[0].decode()[-2000:]}")
        time.sleep(0.1)
