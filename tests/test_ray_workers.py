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
