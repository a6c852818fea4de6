"""One place that starts or attaches to Ray: `tasks.core.executor` (the ingest, curate, quality
and tokens stages) and the Ray MinHash clustering call it.

`init_ray(cfg.ray)` reuses a Ray that is already initialised in this process (a Prefect task
runner, a test fixture), otherwise calls `ray.init` with the config's address and CPU count.
With no address (and no RAY_ADDRESS in the environment) a local Ray is started with
`ray.num_cpus` (address "local": never a cluster some `ray start` on this machine recorded in
/tmp/ray). That Ray is the run's alone: its node address is 127.0.0.1, so its GCS, raylet, object
manager, workers and agents listen on loopback only, and it requires Ray's token authentication
with a token drawn fresh for this start. The token reaches Ray's processes through their
environment at start-up and is then removed from this process's environment again (the pipeline's
other subprocesses never inherit it); it is never written to disk or logged. Without it a driver
attaching to the GCS is refused; the node's dashboard agent runs minimal, with no job API at all.
With an address ("auto", "host:6380", "ray://host:10001") Ray attaches and the CPU count comes
from the cluster, so `num_cpus` is not passed. An address nobody answers on fails at once
(`RayUnreachable`, naming `ray.address`), before a stage writes anything: `ray.init` itself
would retry for a long while.

Which node ran a job: `current_node_id()` inside a task, `node_labels()` in the driver (the
node's name, e.g. `worker-1` of the stack's cluster, else its id).
"""
from __future__ import annotations

import atexit
import logging
import os
import secrets
import socket
import time
from collections import Counter
from contextlib import contextmanager

from tasks.config import RayConfig

CONNECT_TIMEOUT_S = 5.0  # a cluster's GCS answers a TCP connect at once; this only bounds a silent host
LOOPBACK = "127.0.0.1"
# Ray's switch for a machine that runs no multi-node cluster (its default on macOS and Windows). Off,
# Ray keeps a node address of 127.0.0.1 instead of swapping in the host's network address, and its
# servers then bind loopback only (they bind every interface for any other node address).
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class RayUnreachable(ConnectionError):
    """`ray.address` names a Ray cluster nobody answers on."""


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a GCS ("host:port") or Ray Client ("ray://host:port") address; None for
    "auto"/"local" (Ray finds those itself)."""
    rest = address.split("://", 1)[1] if "://" in address else address
    if address in ("auto", "local") or ":" not in rest:
        return None
    host, _, port = rest.rstrip("/").rpartition(":")
    return host.strip("[]"), int(port)


def check_ray_address(cfg: RayConfig | None = None) -> None:
    """Raise `RayUnreachable` when the configured cluster (`ray.address`, else RAY_ADDRESS) does
    not accept a TCP connection within CONNECT_TIMEOUT_S."""
    setting = "ray.address" if cfg is not None and cfg.address else "RAY_ADDRESS"
    address = (cfg.address if cfg is not None else None) or os.environ.get("RAY_ADDRESS")
    if not address:
        return
    try:
        target = _host_port(address)
    except ValueError:
        raise RayUnreachable(f"Ray: {setting}={address!r} is not host:port or ray://host:port") from None
    if target is None:
        return
    try:
        with socket.create_connection(target, timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        raise RayUnreachable(
            f"Ray: no cluster answers at {setting}={address!r} ({e.strerror or e}); start one "
            f"(`crucible up --ray`) or correct {setting}") from None


def init_ray(cfg: RayConfig | None = None) -> bool:
    """Make sure Ray is initialised; returns True when this call started/attached it."""
    import ray

    if ray.is_initialized():
        return False
    cfg = cfg or RayConfig()
    kwargs: dict = {"include_dashboard": False, "ignore_reinit_error": True,
                    "logging_level": logging.WARNING}
    address = cfg.address
    if address is None and not os.environ.get("RAY_ADDRESS"):
        start_local_ray(cfg.num_cpus, **kwargs)
        return True
    check_ray_address(cfg)
    _reload_auth_settings()
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as e:  # e.g. a token-protected cluster (the stack's) without its token
        if cfg.address is None:
            raise
        raise RayUnreachable(f"Ray: could not attach to the cluster at ray.address={cfg.address!r}: {e} (the "
                             "stack's cluster needs RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH, which "
                             "`crucible run` sets)") from e
    return True


def start_local_ray(num_cpus: int | None = None, **init_kwargs) -> None:
    """A new local Ray ("local": never a cluster some `ray start` recorded in /tmp/ray) on
    127.0.0.1 with token authentication and a token of its own (see the module's docstring);
    `init_kwargs` go to ray.init (init_ray's, or a benchmark's object store size). A local Ray
    never runs the dashboard head (`_no_dashboard_head`), so asking for it is an error rather than
    a silently dashboard-less Ray."""
    if init_kwargs.get("include_dashboard"):
        raise ValueError("start_local_ray: include_dashboard=True is not supported: a stage's local Ray "
                         "runs without the dashboard head (attach to a cluster via ray.address for one)")
    import ray
    from ray._private import ray_constants

    # Ray's processes copy the environment when they start (the raylet passes its copy on to every
    # worker it spawns later), so the token and the switch are needed only while ray.init runs
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), SINGLE_NODE_ENV: "0"}
    system = {"num_workers_soft_limit": IDLE_WORKERS_PER_CPU * (num_cpus or _detected_cpus()),
              **init_kwargs.pop("_system_config", {})}
    with _environment(env), _single_node(ray_constants), _local_node_params(), _no_dashboard_head(), \
            _minimal_agent(), _prompt_node_lookup():
        _reload_auth_settings()
        info = ray.init(address="local", num_cpus=num_cpus, _node_ip_address=LOOPBACK, _system_config=system,
                        **init_kwargs)
    # a Ray version that no longer asks utils: the patch did nothing, the agent serves its job API
    if info.address_info.get("dashboard_agent_listen_port") != -1:
        ray.shutdown()
        raise RuntimeError("local Ray: the dashboard agent did not start minimal (ray_utils._minimal_agent no longer "
                           "applies to this Ray version): it would serve a job API")
    atexit.register(_stop_local_ray_at_exit, ray.get_runtime_context().get_node_id())


# Ray's own exit hook waits 0.5 s before stopping its processes, so that worker output still on
# its way is printed; a stage's jobs have all returned by then, their output long printed. Its
# processes are stopped after LOG_GRACE_S instead (a registered hook runs before Ray's own).
LOG_GRACE_S = 0.1


def _stop_local_ray_at_exit(node_id: str) -> None:
    """At exit: stop the local Ray that start_local_ray started, if it is still the one running."""
    import ray

    if ray.is_initialized() and ray.get_runtime_context().get_node_id() == node_id:
        time.sleep(LOG_GRACE_S)
        ray.shutdown()


# Idle worker processes a local Ray keeps per CPU. Ray's default keeps as many as there are CPUs
# free (ray-project/ray#36766): while a stage's actors (curate's, quality's: processes of their
# own, a task worker never becomes one) hold every CPU, it kills the idle task workers after 1 s,
# and the tasks after the actor phase (curate's dedup stages) boot theirs again (~1 s each:
# Python, Ray, the stage's imports) on the stage's critical path. Idle, a worker holds its imports.
IDLE_WORKERS_PER_CPU = 1


def _detected_cpus() -> int:
    """The CPUs a local Ray detects without `num_cpus` (cgroup limits included)."""
    from ray._private.utils import get_num_cpus

    return max(1, int(get_num_cpus()))


@contextmanager
def _environment(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _single_node(ray_constants):
    """Ray reads SINGLE_NODE_ENV once, when it is imported: this process's copy of the setting,
    which decides whether ray.init swaps 127.0.0.1 for the host's address."""
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@contextmanager
def _local_node_params():
    """Node settings ray.init has no argument for. The dashboard agent on a port the OS picks, not
    Ray's fixed 52365: on 127.0.0.1 only, a second Ray on this machine (another run, another user)
    would find 52365 taken and start its agent without its HTTP server. No autoscaler monitor: a
    local Ray has no nodes to add (its Python process cost ~0.5 CPU s per run)."""
    from ray._private import parameter

    base = parameter.RayParams

    class Params(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("dashboard_agent_listen_port", 0)
            kwargs["no_monitor"] = True
            super().__init__(*args, **kwargs)

    parameter.RayParams = Params
    try:
        yield
    finally:
        parameter.RayParams = base


@contextmanager
def _no_dashboard_head():
    """No dashboard head process on a local Ray. `include_dashboard=False` still starts one (with
    only its usage-stats module) and ray.init polls until it has registered: ~1 s of every start
    and ~0.9 CPU s. Nothing here uses its job or state APIs (the node's dashboard agent, which
    the raylet starts, still runs and still requires the token)."""
    from ray._private.node import Node

    start = Node.start_api_server
    Node.start_api_server = lambda self, **_: None  # _webui_url stays None: "no dashboard"
    try:
        yield
    finally:
        Node.start_api_server = start


@contextmanager
def _minimal_agent():
    """The node's dashboard agent in its minimal mode (what Ray runs where the dashboard's packages
    are not installed): no HTTP server, so no job API that a job could be posted to, and the raylet
    and the workers get no metrics agent (the agent process, which still finds the packages, serves
    node metrics on loopback only). ray.init decides the mode by importing those packages (aiohttp,
    opentelemetry, prometheus: ~0.3 s of every start, in the driver); this Ray needs no job API."""
    from ray._private import utils

    check = utils.get_dashboard_dependency_error
    utils.get_dashboard_dependency_error = lambda: ImportError("local Ray: minimal dashboard agent")
    try:
        yield
    finally:
        utils.get_dashboard_dependency_error = check


NODE_POLL_S = 0.05  # how often a starting local Ray's node is looked for in the GCS
NODE_WAIT_S = 30.0  # Ray's own bound on the raylet's registration (node.py: raylet_start_wait_time_s)


@contextmanager
def _prompt_node_lookup():
    """ray.init looks the new node up in the GCS 0.1 s after starting the raylet, which registers
    only once its agents have booted (~1 s). Ray's lookup (GlobalStateAccessor::GetNode) sleeps a
    whole second between tries, so every start waited up to a second past the registration (2.0 s
    measured for a ~1.1 s boot). Here the node is polled every NODE_POLL_S first; Ray's own lookup
    then finds it on its first try."""
    from ray._private import services

    get_node = services.get_node

    def prompt_get_node(gcs_address: str, node_id: str):
        _wait_registered(gcs_address, node_id)
        return get_node(gcs_address, node_id)

    services.get_node = prompt_get_node
    try:
        yield
    finally:
        services.get_node = get_node


def _wait_registered(gcs_address: str, node_id: str, timeout_s: float = NODE_WAIT_S) -> bool:
    """Whether node `node_id` (hex) registered with the GCS at `gcs_address` within `timeout_s`;
    an error asking is left to Ray's own lookup, which follows, to report."""
    from ray._raylet import GcsClient, NodeID

    try:
        client, node = GcsClient(address=gcs_address), NodeID.from_hex(node_id)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if node in client.get_all_node_info(timeout=5):
                return True
            time.sleep(NODE_POLL_S)
    except Exception:  # noqa: BLE001 - Ray's lookup runs next and raises with its own message
        pass
    return False


def _reload_auth_settings() -> None:
    """Make Ray read RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH again: it caches them at the first Ray
    session of the process, so a process that ran a local Ray (auth disabled) could not attach to
    the stack's token-protected cluster afterwards (what Ray's own tests do between sessions)."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # a Ray without token authentication: nothing cached
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def cluster_cpus() -> int:
    """Number of CPUs Ray can schedule on (at least 1)."""
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def only_this_node() -> bool:
    """Whether the Ray this driver is attached to has no alive node but the driver's own (a local
    Ray): every task shares the driver's disk."""
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")} <= {current_node_id()}


def current_node_id() -> str:
    """The Ray node this task or actor runs on (hex id)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def node_labels(node_ids) -> dict[str, str]:
    """{node id: label}: the node's name where it is unique in the cluster (the stack names its
    nodes head, worker-1, ...), else its id (a local Ray's single node is named by its IP)."""
    import ray

    names = {n["NodeID"]: n.get("NodeName") or "" for n in ray.nodes()}
    taken = Counter(names.values())
    return {i: names[i] if names.get(i) and taken[names[i]] == 1 else i for i in node_ids}


def tasks_per_node(counts: Counter) -> dict[str, int]:
    """{node label: jobs run there} for a stage summary, busiest node first."""
    if not counts:
        return {}
    labels = node_labels(counts)
    out: Counter = Counter()
    for node, n in counts.items():
        out[labels[node]] += n
    return dict(out.most_common())
