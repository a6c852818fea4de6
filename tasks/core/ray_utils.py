"""One place that starts or attaches to Ray: `tasks.core.executor` (the ingest, curate, quality
and tokens stages) and the Ray MinHash clustering call it.

`init_ray(cfg.ray)` reuses a Ray that is already initialised in this process (a Prefect task
runner, a test fixture), otherwise calls `ray.init` with the config's address and CPU count.
With no address (and no RAY_ADDRESS in the environment) a local Ray is started with
`ray.num_cpus`; `RAY_AUTH_MODE=disabled` is set for it unless the environment says otherwise.
With an address ("auto", "ray://host:10001") Ray attaches and the CPU count comes from the
cluster, so `num_cpus` is not passed.
"""
from __future__ import annotations

import logging
import os

from tasks.config import RayConfig


def init_ray(cfg: RayConfig | None = None) -> bool:
    """Make sure Ray is initialised; returns True when this call started/attached it."""
    import ray

    if ray.is_initialized():
        return False
    cfg = cfg or RayConfig()
    kwargs: dict = {"include_dashboard": False, "ignore_reinit_error": True,
                    "logging_level": logging.WARNING}
    if cfg.address is None and not os.environ.get("RAY_ADDRESS"):
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        kwargs["num_cpus"] = cfg.num_cpus
    ray.init(address=cfg.address, **kwargs)
    return True


def cluster_cpus() -> int:
    """Number of CPUs Ray can schedule on (at least 1)."""
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))
