"""The local Ray a stage starts keeps its worker processes between the stages' phases: the tasks
after an actor phase (curate's dedup stages after its map) run in the processes that ran the
tasks before it (ingest's), not in freshly booted ones (`tasks.core.ray_utils.IDLE_WORKERS_PER_CPU`)."""
from __future__ import annotations

import os
import time

import ray


def test_task_workers_survive_an_actor_phase():
    from tasks.core.ray_utils import start_local_ray

    if ray.is_initialized():
        ray.shutdown()
    start_local_ray(2, include_dashboard=False, ignore_reinit_error=True)
    try:
        @ray.remote(num_cpus=1)
        def pid(_):
            time.sleep(0.2)
            return os.getpid()

        @ray.remote(num_cpus=1)
        class Actor:
            def pid(self):
                return os.getpid()

        before = set(ray.get([pid.remote(i) for i in range(4)]))
        actors = [Actor.remote() for _ in range(2)]
        actor_pids = set(ray.get([a.pid.remote() for a in actors]))
        time.sleep(2.5)  # past Ray's idle-worker killing (1 s) for workers beyond its soft limit
        for a in actors:
            ray.kill(a)
        after = set(ray.get([pid.remote(i) for i in range(4)]))
        assert not actor_pids & before  # an actor takes a process of its own
        assert after and after <= before, (before, after)
    finally:
        ray.shutdown()


def test_local_ray_start_looks_its_node_up_once_registered(monkeypatch):
    """ray.init's own lookup of the new node (which sleeps a whole second between tries) runs only
    once the raylet has registered with the GCS: `ray_utils._prompt_node_lookup` polls for it first.
    Ray asks 0.1 s after starting the raylet, which registers only after its agents boot (~1 s)."""
    from ray._private import services
    from ray._raylet import GcsClient, NodeID

    from tasks.core.ray_utils import start_local_ray

    registered_at_lookup = []
    lookup = services.get_node

    def spy(gcs_address, node_id):
        nodes = GcsClient(address=gcs_address).get_all_node_info(timeout=5)
        registered_at_lookup.append(NodeID.from_hex(node_id) in nodes)
        return lookup(gcs_address, node_id)

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setattr(services, "get_node", spy)
    start_local_ray(1, include_dashboard=False)
    try:
        assert registered_at_lookup == [True]
    finally:
        ray.shutdown()
    assert services.get_node is spy  # put back after the start


EXITING = """
import atexit, sys, time
slept = []
sleep = time.sleep
time.sleep = lambda s: slept.append(s) or sleep(s)
atexit.register(lambda: print("SLEPT", slept, flush=True))  # registered first: runs last
import ray
from tasks.core.ray_utils import start_local_ray
start_local_ray(1, include_dashboard=False)
ray.get(ray.remote(lambda: 1).remote())
slept.clear()
"""


def test_a_local_ray_is_stopped_at_exit_without_rays_half_second_wait():
    """A process that started a local Ray stops it at exit itself (`ray_utils._stop_local_ray_at_exit`,
    after LOG_GRACE_S): Ray's own exit hook, which sleeps 0.5 s first, then finds nothing to stop."""
    import ast
    import subprocess
    import sys

    from tasks.core.ray_utils import LOG_GRACE_S

    proc = subprocess.run([sys.executable, "-c", EXITING], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    slept = ast.literal_eval(proc.stdout.split("SLEPT", 1)[1].strip())
    assert LOG_GRACE_S in slept and 0.5 not in slept, slept
