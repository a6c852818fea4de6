"""The stack's Ray cluster with real processes: a head (0 CPUs) and two 1-CPU worker nodes started
by infra/stack.py on free ports, ingest + curate of a small real sample run on it, against
a local-Ray run of the same input; a worker node's raylet killed mid-stage; an unreachable
`ray.address`."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from attack_helpers import descendant_pids
from infra import stack
from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, IngestConfig, PipelineConfig, RayConfig, SourceConfig
from tasks.core.documents import iter_docs

REPO = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
WEB = DATA / "web"
pytestmark = pytest.mark.skipif(not (WEB / "docs-crawl-00000.warc.gz").exists(), reason=f"no data under {DATA}")


def _pipeline(root: Path, address: str | None) -> PipelineConfig:
    """48 docs-crawl pages (a capped source: its file is split into a range per CPU) and the 15
    wget pages; 10-document ingest shards, so curate has a dozen jobs (one per row group)."""
    sources = [SourceConfig(name="docs", uri="web/docs-crawl-00000.warc.gz", format="warc", licence="test",
                            provenance="shared/data", max_docs=48),
               SourceConfig(name="wget", uri="web/wget-sample-0001.warc.gz", format="warc", licence="test",
                            provenance="shared/data")]
    return PipelineConfig(name="ray-cluster-test", sources=sources, data_root=str(DATA), run_root=str(root),
                          ingest=IngestConfig(shard_docs=10), ray=RayConfig(address=address, num_cpus=2))


def _documents(summary: dict) -> list[tuple[str, str]]:
    return [(d["id"], d["text"]) for d in iter_docs(summary["shards"])]


def _ingest_and_curate(cfg: PipelineConfig, out: Path, progress=None) -> tuple[dict, dict]:
    from tasks.curate import run_curate
    from tasks.ingest import run_ingest

    ingested = run_ingest(cfg, out / "ingest")
    return ingested, run_curate(cfg, [Path(s) for s in ingested["shards"]], out / "curate", progress=progress)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The reference: the same stages on a local 2-CPU Ray, shut down before the cluster attaches."""
    import ray

    from tasks.core.ray_utils import init_ray

    ray.shutdown()
    init_ray(RayConfig(num_cpus=2))
    try:
        return _ingest_and_curate(_pipeline(tmp_path_factory.mktemp("local"), None), tmp_path_factory.mktemp("local-out"))
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def cluster(local_run, tmp_path_factory):
    """A head and two worker nodes, started and stopped by the stack's own code; this process
    attached to it as a driver (with the cluster's token) for the module."""
    import ray

    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    t0 = time.monotonic()
    cfg = stack.up_ray_on_free_ports(str(tmp_path_factory.mktemp("state")), ray_workers=2, ray_head_cpus=0,
                                     ray_worker_cpus=1, ray_object_store_mb=128, start_timeout=120, stop_timeout=15)
    try:
        print(f"\ncluster up in {time.monotonic() - t0:.1f}s")
        os.environ.update(stack.ray_client_env(cfg))
        yield cfg
    finally:
        ray.shutdown()
        stopped = stack.down_ray(cfg)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        assert set(stopped) == {"ray_head", "ray_worker_1", "ray_worker_2"}
        for name in stopped:  # nothing of any node is left: no stray raylet
            assert stack.running_pid(cfg, name) is None


def test_status_shows_every_node_alive(cluster):
    st = stack.ray_status(cluster)
    assert [n for n in st] == ["ray_head", "ray_worker_1", "ray_worker_2"]
    assert all(s["healthy"] and s["pid"] for s in st.values())
    assert st["ray_head"]["nodes"] == "3 of 3 Ray nodes alive"
    assert st["ray_head"]["address"] == stack.cluster_address(cluster) == f"127.0.0.1:{cluster.ray_port}"
    # the stack's own status lists the nodes too
    assert {k for k in stack.status(cluster) if k.startswith("ray_")} == set(st)


def test_driver_or_job_without_the_clusters_token_is_refused(cluster, tmp_path):
    """The cluster's GCS and agents listen on every interface (Ray binds them for a multi-node
    cluster): a driver without the stack's token, or with another, is refused and runs nothing, and
    so is a job posted to a node agent's job API."""
    import sys

    from test_ray_security import WITHOUT_TOKEN, _post, assert_attach_refused

    for name, auth in WITHOUT_TOKEN.items():
        assert_attach_refused(stack.cluster_address(cluster), tmp_path / f"{name}-ran", auth)
    marker = tmp_path / "job-ran"
    entrypoint = f"{sys.executable} -c \"open({str(marker)!r}, 'w').write('ran')\""
    for port in (cluster.ray_agent_port, cluster.ray_agent_port + 1):  # the head's agent, worker-1's
        url = f"http://127.0.0.1:{port}/api/job_agent/jobs/"
        assert _post(url, {"entrypoint": entrypoint}) in (401, 403), url
    time.sleep(3)
    assert not marker.exists()


def test_curate_on_two_nodes_equals_local_ray(cluster, local_run, tmp_path):
    """Every curate job ran on a worker node (the head has no CPUs), both nodes took some, and the
    curated documents (ids and texts) and drops are those of the local run."""
    ingested, curated = _ingest_and_curate(_pipeline(tmp_path, stack.cluster_address(cluster)), tmp_path)
    local_ingested, local_curated = local_run
    print(f"\nnodes: ingest {ingested['nodes']}, curate {curated['nodes']}")
    assert curated["jobs"] >= 4 and curated["jobs_rerun"] == 0
    assert set(curated["nodes"]) == {"worker-1", "worker-2"}
    assert sum(curated["nodes"].values()) == curated["jobs"]
    assert set(ingested["nodes"]) <= {"worker-1", "worker-2"} and sum(ingested["nodes"].values()) == ingested["jobs"]
    # where the map's time went: every job's seconds on its node, within the workers' wall time
    jobs = curated["timings"]["jobs"]
    assert jobs["jobs_run"] == curated["jobs"] and jobs["result_bytes"] > 0
    assert 0 < jobs["compute_s"] <= jobs["map_wall_s"] * jobs["workers"]
    assert _documents(ingested) == _documents(local_ingested)
    assert curated["docs_out"] > 0 and _documents(curated) == _documents(local_curated)
    assert curated["dropped"] == local_curated["dropped"]


def _raylet_pid(stack_cfg, service: str) -> int:
    pgid = stack.running_pid(stack_cfg, service)
    pids = [p for p in stack.group_pids(pgid) if "raylet/raylet" in stack.process_cmdline(p)]
    assert len(pids) == 1, pids
    return pids[0]


def _node_pids(stack_cfg, service: str) -> set[int]:
    """Every process of a node: its `ray start` group and all their descendants (Ray's worker
    processes, the actors among them)."""
    return descendant_pids(set(stack.group_pids(stack.running_pid(stack_cfg, service))))


def test_worker_node_killed_mid_stage_curate_completes_identically(cluster, local_run, tmp_path):
    """SIGKILL every process of worker-1 (raylet and actors: the machine is gone) as soon as the
    first curate job is back: the job its actor held, or was given next, runs again on worker-2,
    and the output is unchanged. (Killing the raylet alone is not enough: an actor's process can
    go on answering the driver directly for a while, so whether a job is lost would be timing.)"""
    from tasks.curate import run_curate

    local_ingested, local_curated = local_run
    cfg = _pipeline(tmp_path, stack.cluster_address(cluster))
    killed = []

    def kill_worker_1(done: int, total: int, note: str) -> None:
        if done >= 1 and not killed:
            assert _raylet_pid(cluster, "ray_worker_1")
            for pid in _node_pids(cluster, "ray_worker_1"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed.append(time.monotonic())

    curated = run_curate(cfg, [Path(s) for s in local_ingested["shards"]], tmp_path / "curate", progress=kill_worker_1)
    print(f"\nnodes after the kill: {curated['nodes']}, jobs rerun {curated['jobs_rerun']}")
    assert killed and curated["jobs_rerun"] >= 1
    assert sum(curated["nodes"].values()) == curated["jobs"] >= 4
    assert curated["nodes"]["worker-2"] > curated["nodes"].get("worker-1", 0)
    assert _documents(curated) == _documents(local_curated)
    assert curated["dropped"] == local_curated["dropped"]
    # the node's `ray start` saw its raylet die and exited: status shows it down
    deadline = time.monotonic() + 30
    while stack.running_pid(cluster, "ray_worker_1") is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert stack.ray_status(cluster)["ray_head"]["nodes"] == "2 of 3 Ray nodes alive"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_ray_address_fails_fast_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """`crucible run` with a ray.address nobody answers on: exit 1 within seconds, naming Ray and
    the setting, before the stack is started or anything is written under run_root; the flow's
    own check (open_run) refuses it before the run directory exists."""
    from infra.cli.main import main
    from tasks.core.ray_utils import RayUnreachable

    address = f"127.0.0.1:{_closed_port()}"
    # main() sets $CRUCIBLE_STATE_DIR from --state-dir: set here first, so it is undone after the test
    monkeypatch.setenv(stack.STATE_DIR_ENV, str(tmp_path / "state"))
    run_root = tmp_path / "runs"
    t0 = time.monotonic()
    code = main(["--state-dir", str(tmp_path / "state"), "run", str(REPO / "configs" / "tiny.yaml"),
                 "--set", f"ray.address={address}",
                 "--set", f"run_root={run_root}"])
    assert code == 1 and time.monotonic() - t0 < 30
    err = capsys.readouterr().err
    assert "Ray" in err and f"ray.address='{address}'" in err and "refused" in err.lower()
    assert not run_root.exists() and not (tmp_path / "state").exists()

    from flows.run_context import open_run

    with pytest.raises(RayUnreachable, match=r"Ray: no cluster answers at ray\.address="):
        open_run(_pipeline(run_root, address), "unreachable")
    assert not run_root.exists()
