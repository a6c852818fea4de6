"""The per-run local Ray a stage starts (`tasks.core.executor.start_ray` -> `init_ray`) as an
outsider finds it: every socket any of its processes listens on is a loopback one; its dashboard
agent runs without the job API (minimal mode), and a job posted to any port it listens on never runs;
a driver that attaches without the token (or with a wrong one) is refused and runs nothing; the
token is fresh per run, kept out of the driver's environment and out of Ray's session files."""
from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from attack_helpers import descendant_pids
from tasks.config import RayConfig

TCP_LISTEN = "0A"  # /proc/net/tcp state of a listening socket


def _listening_sockets() -> dict[int, tuple[str, int]]:
    """{socket inode: (address, port)} of every TCP socket listening on this machine."""
    found = {}
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != TCP_LISTEN:
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)  # the kernel writes each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found[int(fields[9])] = (socket.inet_ntop(family, raw), int(port, 16))
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _ray_listeners() -> list[tuple[int, str, str, int]]:
    """(pid, command, address, port) of each listening socket held by this process or any process
    below it."""
    listening = _listening_sockets()
    return [(pid, _cmdline(pid), *listening[inode])
            for pid in sorted(descendant_pids({os.getpid()})) for inode in _socket_inodes(pid) if inode in listening]


def _raylet_pid() -> int:
    pids = [p for p in descendant_pids({os.getpid()}) if "raylet/raylet" in _cmdline(p)]
    assert len(pids) == 1, pids
    return pids[0]


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


@pytest.fixture
def stage_ray():
    """A local Ray started as every Ray stage starts it, with a task run so worker processes exist
    too: its node's address_info. One per test: a test may stop it and start another."""
    import ray

    from tasks.core.executor import start_ray

    ray.shutdown()  # another module's session: this module starts its own, as a stage of a run does
    assert start_ray(RayConfig(num_cpus=1)) >= 1

    @ray.remote
    def pid() -> int:
        return os.getpid()

    assert ray.get(pid.remote(), timeout=120) != os.getpid()
    yield dict(ray._private.worker._global_node.address_info)
    ray.shutdown()


def test_every_ray_process_listens_on_loopback_only(stage_ray):
    listeners = _ray_listeners()
    gcs_port = int(stage_ray["gcs_address"].rsplit(":", 1)[1])
    ports = {port for *_, port in listeners}
    # the GCS and the raylet are among them: the scan sees Ray's servers at all
    raylet_ports = {port for pid, *_, port in listeners if pid == _raylet_pid()}
    assert gcs_port in ports and raylet_ports, listeners
    exposed = [(pid, cmd[:120], address, port) for pid, cmd, address, port in listeners if not _is_loopback(address)]
    assert not exposed, "Ray listens beyond loopback:\n" + "\n".join(map(str, exposed))
    assert stage_ray["node_ip_address"] == "127.0.0.1"
    assert stage_ray["gcs_address"].startswith("127.0.0.1:")


def _post(url: str, body: dict, token: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def _post_anywhere(url: str, body: dict) -> int | None:
    """`_post`, or None where the port does not answer HTTP (a gRPC server drops the request)."""
    import http.client

    try:
        return _post(url, body)
    except (OSError, http.client.HTTPException):
        return None


def test_no_job_api_and_a_job_posted_to_any_ray_port_never_runs(stage_ray, tmp_path):
    """The node's dashboard agent runs minimal (`ray_utils._minimal_agent`): no HTTP server, so no
    job API at all; a job posted without the run's token to every port the run's Ray listens on is
    not accepted anywhere and never runs."""
    assert stage_ray["dashboard_agent_listen_port"] == -1
    agents = [_cmdline(p) for p in descendant_pids({os.getpid()}) if "dashboard/agent.py" in _cmdline(p)]
    assert len(agents) == 1 and " --minimal" in agents[0], agents
    marker = tmp_path / "job-ran"
    entrypoint = f"{sys.executable} -c \"open({str(marker)!r}, 'w').write('ran')\""
    ports = sorted({port for *_, port in _ray_listeners()})
    assert ports
    for port in ports:  # the agent's job API and the dashboard head's
        for path in ("/api/job_agent/jobs/", "/api/jobs/"):
            status = _post_anywhere(f"http://127.0.0.1:{port}{path}", {"entrypoint": entrypoint})
            assert status is None or not 200 <= status < 300, f"port {port} accepted a job at {path} ({status})"
    time.sleep(3)  # an accepted job's entrypoint starts within a second or two
    assert not marker.exists(), "the unauthenticated job's entrypoint ran"


ATTACH = textwrap.dedent("""
    import pathlib, sys
    import ray
    ray.init(address=sys.argv[1], logging_level="ERROR")

    @ray.remote
    def touch(path):
        pathlib.Path(path).write_text("ran")

    ray.get(touch.remote(sys.argv[2]), timeout=60)
""")


WITHOUT_TOKEN = {"no-token": {"RAY_AUTH_MODE": "disabled"},
                 "wrong-token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "a-guessed-token-" + "0" * 32}}


def assert_attach_refused(address: str, marker: Path, auth: dict) -> None:
    """A driver in a fresh process, with `auth` for its Ray settings, attaches to the GCS at
    `address` and runs a task that writes `marker`: it must be refused by the GCS for want of the
    token (not merely fail to reach it), and nothing may run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # the attacker's own settings: dial the recorded address as it is (a driver swaps 127.0.0.1 for
    # the host's address unless told it is on a single-node machine), and give up after 2 tries
    env.update(auth, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_NUM_REDIS_GET_RETRIES="2")
    proc = subprocess.run([sys.executable, "-c", ATTACH, address, str(marker)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert not marker.exists(), "a driver without the token ran a task"
    assert proc.returncode != 0 and "InvalidAuthToken" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("auth", WITHOUT_TOKEN.values(), ids=WITHOUT_TOKEN.keys())
def test_driver_attaching_without_the_token_is_refused(stage_ray, tmp_path, auth):
    assert_attach_refused(stage_ray["gcs_address"], tmp_path / "driver-ran", auth)


def test_token_is_fresh_per_run_and_never_written_or_inherited(stage_ray):
    import ray

    from tasks.core.executor import start_ray

    token = _environ_of(_raylet_pid()).get("RAY_AUTH_TOKEN", "")
    assert len(token) >= 32 and _environ_of(_raylet_pid()).get("RAY_AUTH_MODE") == "token"
    # the driver's environment (which the pipeline's own subprocesses inherit) never holds it
    assert token not in os.environ.values() and "RAY_AUTH_TOKEN" not in os.environ
    session = Path(stage_ray["session_dir"])
    leaked = [p for p in session.rglob("*") if p.is_file() and not p.is_socket() and token.encode() in p.read_bytes()]
    assert not leaked, f"the token is written in {leaked}"
    ray.shutdown()
    try:
        start_ray(RayConfig(num_cpus=1))
        assert _environ_of(_raylet_pid()).get("RAY_AUTH_TOKEN") not in ("", None, token)
    finally:
        ray.shutdown()


def test_local_ray_runs_no_dashboard_head_or_autoscaler_monitor(stage_ray):
    """A stage's local Ray leaves out the two Python daemons it has no use for (`ray_utils`:
    `_no_dashboard_head`, `_local_node_params`): ~1 s of every start and ~1.4 CPU s per run."""
    import ray
    from ray._private import ray_constants

    node = ray._private.worker._global_node
    started = set(node.all_processes)
    assert ray_constants.PROCESS_TYPE_RAYLET in started  # the listing is the node's real one
    assert ray_constants.PROCESS_TYPE_DASHBOARD not in started and stage_ray.get("webui_url") is None
    assert ray_constants.PROCESS_TYPE_MONITOR not in started
    commands = [_cmdline(p) for p in descendant_pids({os.getpid()})]
    assert not [c for c in commands if "dashboard/dashboard.py" in c or "autoscaler/_private/monitor.py" in c]


def test_local_ray_refuses_include_dashboard(monkeypatch):
    """start_local_ray never starts the dashboard head: include_dashboard=True is refused before
    any Ray starts, not silently dropped."""
    import ray

    from tasks.core.ray_utils import start_local_ray

    def no_init(*args, **kwargs):
        raise AssertionError("ray.init called")

    monkeypatch.setattr(ray, "init", no_init)
    with pytest.raises(ValueError, match="include_dashboard=True is not supported"):
        start_local_ray(1, include_dashboard=True)
    with pytest.raises(AssertionError, match="ray.init called"):  # False still reaches ray.init
        start_local_ray(1, include_dashboard=False)
