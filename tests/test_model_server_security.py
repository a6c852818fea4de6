"""The model server nobody can starve or impersonate (issue 24, requirement 5), each tried as an
outsider on the host would: an anonymous client of the stack-started server, a crowd of abandoned and
slow non-streamed requests, and an impostor that binds the server's port while the supervisor
(re)starts it. All loopback, each bounded and stopping by itself."""
from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from infra import stack
from infra.services.model_server import supervisor
from infra.services.model_server.server import create_app
from lm_helpers import random_checkpoint, sample_tokenizer
from infra.settings import StackConfig
from tasks.config import DeployConfig
from tasks.core.net import free_port
from tasks.deploy.generation import TextGenerator

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("model-server-security")
    tok = sample_tokenizer(root / "tokenizer.json")
    return {"tokenizer": tok, "ckpt": random_checkpoint(root / "train", tok, 10, 0), "root": root}


@pytest.fixture
def stack_cfg(tmp_path, monkeypatch):
    monkeypatch.delenv(stack.STATE_DIR_ENV, raising=False)
    return StackConfig(state_dir=str(tmp_path / "state"), prefect_port=free_port(), mlflow_port=free_port(),
                       start_timeout=120, stop_timeout=10)


def test_the_stack_started_server_refuses_anonymous_clients_by_default(tiny, stack_cfg):
    """Nothing configured: the server the stack starts still requires the clients' key, generated
    into the stack's secrets folder (0600) and handed over as a path, never a value."""
    deploy_cfg = DeployConfig(model_name="m", port=free_port(), threads=1)
    started = supervisor.start_or_refresh_server(stack_cfg, deploy_cfg, tiny["ckpt"], tiny["tokenizer"], "m")
    try:
        url = started["endpoint"]
        body = {"prompt": "The", "max_tokens": 2}
        anonymous = httpx.post(f"{url}/completions", json=body, timeout=30, trust_env=False)
        assert anonymous.status_code == 401, anonymous.text
        assert httpx.get(f"{url}/models", timeout=30, trust_env=False).status_code == 401
        key_file = stack.state_dir(stack_cfg) / "secrets" / supervisor.CLIENT_KEY_FILE
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
        key = key_file.read_text().strip()
        ok = httpx.post(f"{url}/completions", json=body, timeout=30, trust_env=False,
                        headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200 and ok.json()["choices"], ok.text
        spec_text = (stack.state_dir(stack_cfg) / "run" / f"{stack.MODEL_SERVER}.json").read_text()
        assert key not in spec_text and str(key_file) in spec_text  # the path, never the value
        assert key not in stack.log_path(stack_cfg, stack.MODEL_SERVER).read_text()
    finally:
        with stack.stack_lock(stack_cfg):
            stack.stop_service(stack_cfg, stack.MODEL_SERVER, forget=True)


def _send_raw(port: int, body: dict, path: str = "/v1/completions", headers: dict | None = None) -> socket.socket:
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{head}"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_abandoned_and_slow_requests_do_not_starve_health_or_the_admin_api(tiny, tmp_path):
    """48 non-streamed requests, each asking for 16 x 1024 tokens decoded one sequence at a time:
    half abandoned (the client hangs up at once), half slow (the client never reads). /health and
    the admin API still answer within seconds."""
    port, admin = free_port(), tmp_path / "admin.key"
    admin.write_text("adm1n-" + os.urandom(8).hex())
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "infra.services.model_server", "--checkpoint", str(tiny["ckpt"]),
           "--tokenizer", str(tiny["tokenizer"]), "--model-name", "m", "--port", str(port), "--threads", "1",
           "--max-batch", "1", "--admin-key-file", str(admin)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 120
        while not stack.http_ok(f"http://127.0.0.1:{port}/health", timeout=1):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        body = {"prompt": "The Linux kernel", "max_tokens": 1024, "n": 16, "temperature": 1.0}
        for i in range(48):
            s = _send_raw(port, body)
            if i % 2:
                held.append(s)
            else:
                s.close()
        time.sleep(1.0)  # the server has read them all
        # each must answer within its client timeout (5 s; a starved server lets it pass): httpx raises
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5, trust_env=False)
        assert r.status_code == 200
        r = httpx.post(f"http://127.0.0.1:{port}/v1/admin/reload", json={"version": 2}, timeout=5, trust_env=False,
                       headers={"Authorization": f"Bearer {admin.read_text().strip()}"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_registry", r.text  # it answered
    finally:
        for s in held:
            s.close()
        proc.kill()
        proc.wait(30)


def test_admission_limit_and_timeout_of_non_streamed_requests(tiny):
    """Beyond max_requests concurrent non-streamed completions, a request gets 429 at once; one
    that outlives request_timeout gets 503 and gives its slot back (its choices are cancelled)."""
    gen = TextGenerator.from_files(tiny["ckpt"], tiny["tokenizer"])
    app = create_app(gen, "m", max_batch=1, max_requests=2, request_timeout=2.0)
    slow = {"prompt": "x", "max_tokens": 1024, "n": 16, "temperature": 1.0}
    with TestClient(app) as c:
        answers: list = []
        threads = [threading.Thread(target=lambda: answers.append(c.post("/v1/completions", json=slow)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while app.state.crucible.requests._value:  # both slots taken (polled: no race with the threads)
            assert time.monotonic() < deadline, "the two slow requests were never admitted"
            time.sleep(0.05)
        extra = c.post("/v1/completions", json=slow)  # refused at once, not queued behind them
        assert extra.status_code == 429 and extra.json()["error"]["code"] == "too_many_requests"
        assert c.get("/health").status_code == 200
        for t in threads:
            t.join(30)
        assert [a.status_code for a in answers] == [503, 503], [a.text for a in answers]
        assert answers[0].json()["error"]["code"] == "timeout"
        ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})  # the slots came back
        assert ok.status_code == 200, ok.text


class _Impostor:
    """A local process's HTTP server on the model server's port: /health answers 200 (with whatever
    identity it can make up), a completion answers a choice; it records every request it gets."""

    def __init__(self, port: int):
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, body: dict) -> None:
                length = int(self.headers.get("content-length") or 0)
                seen.append((self.command, self.path, dict(self.headers), self.rfile.read(length)))
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._answer({"status": "ok", "step": 10, "identity": "0" * 64})

            def do_POST(self):  # noqa: N802
                self._answer({"choices": [{"text": "x", "index": 0}], "status": "reloaded", "version": 1})

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def leaked(self, *secrets: str) -> list:
        return [(m, p) for m, p, h, b in self.seen
                if h.get("Authorization") or any(s and (s in json.dumps(h) or s.encode() in b) for s in secrets)]


def test_an_impostor_on_the_port_is_not_trusted_and_receives_no_key(tiny, stack_cfg, monkeypatch):
    """The supervisor (re)starts the server; before the server binds its port, a local process binds
    it and answers /health. Neither the supervisor, nor the stack's health check, nor a challenger's
    verification trusts it, and it never receives the clients' key or the admin key."""
    monkeypatch.setenv("CRUCIBLE_TEST_MODEL_KEY", "client-" + os.urandom(8).hex())
    deploy_cfg = DeployConfig(model_name="m", port=free_port(), threads=1, verify_port=free_port(),
                              api_key_env="CRUCIBLE_TEST_MODEL_KEY")
    impostors: list[_Impostor] = []
    launch = stack._launch

    def launch_then_race(cfg, spec):  # the port is free while the new server imports torch: take it
        pid = launch(cfg, spec)
        impostors.append(_Impostor(spec.port))
        return pid

    monkeypatch.setattr(stack, "_launch", launch_then_race)
    try:
        with pytest.raises((stack.StackError, RuntimeError)):
            supervisor.verify_model(SimpleNamespace(stack=stack_cfg, deploy=deploy_cfg), tiny["ckpt"],
                                    tiny["tokenizer"], "m")
        with pytest.raises(stack.StackError):
            supervisor.start_or_refresh_server(stack_cfg, deploy_cfg, tiny["ckpt"], tiny["tokenizer"], "m",
                                               timeout=60)
        assert len(impostors) == 2
        # the stack's own health check of the model server, against the impostor still on the port
        spec = supervisor.server_spec(deploy_cfg, tiny["ckpt"], tiny["tokenizer"], "m", stack_cfg)
        assert not stack.service_healthy(spec)
        admin = supervisor.admin_key_file(stack_cfg).read_text().strip()
        for imp in impostors:
            assert imp.seen, "the impostor was never asked"
            assert imp.leaked(os.environ["CRUCIBLE_TEST_MODEL_KEY"], admin) == []
            assert all(m == "GET" for m, *_ in imp.seen), imp.seen  # nothing but the challenge
    finally:
        for imp in impostors:
            imp.close()
        with stack.stack_lock(stack_cfg):
            for name in (stack.MODEL_SERVER, f"{supervisor.VERIFY_SERVER}-{deploy_cfg.verify_port}"):
                stack.stop_service(stack_cfg, name, forget=True)


def test_a_reload_in_place_sends_the_admin_key_to_no_impostor(tiny, stack_cfg, monkeypatch):
    """The recorded server's process is alive but not (yet) on its port (e.g. still loading after
    `crucible up`) and a local process holds the port: the supervisor's reload in place must not
    hand it the admin key; it restarts the server instead (returns None)."""
    deploy_cfg = DeployConfig(model_name="m", port=free_port(), threads=1)
    old = supervisor.server_spec(deploy_cfg, tiny["ckpt"], tiny["tokenizer"], "m", stack_cfg, version=1)
    stack.write_spec(stack_cfg, old)
    monkeypatch.setattr(stack, "running_pid", lambda cfg, name: os.getpid())
    impostor = _Impostor(deploy_cfg.port)
    try:
        new = supervisor.server_spec(deploy_cfg, tiny["ckpt"], tiny["tokenizer"], "m", stack_cfg, version=2)
        assert supervisor._reload_in_place(stack_cfg, deploy_cfg, new) is None
        admin = supervisor.admin_key_file(stack_cfg).read_text().strip()
        assert impostor.seen and impostor.leaked(admin) == []
        assert all(m == "GET" for m, *_ in impostor.seen), impostor.seen
    finally:
        impostor.close()
