"""The one executor of the Ray stages (ingest, curate, quality): start or attach Ray, plan jobs,
reuse the finished ones, run the rest on Ray, merge, write the manifest last.

- `ResumableOutput`: a stage's output directory (`tasks.core.resume` has the on-disk rules).
  `completed()` is the stored summary when the manifest verifies; `start(resume)` invalidates the
  old output (manifest first, so a kill never leaves a stale one) and gives the `JobStore` of
  `_parts`; `publish(summary)` writes the manifest of the merged output and drops `_parts`.
- `Job`: one unit of work: a name (also the prefix of its part files), a key (everything its
  output depends on; None: never stored) and the worker's arguments.
- `RayTasks` (a Ray task per job) and `RayActors` (a pool of actors, each built once, e.g. to
  load a model once) run jobs; `JobRunner` reuses a job whose key and parts verify in the store,
  runs the others on its workers, stores each result as it comes back and hands it over.
  Jobs may be submitted while others run (ingest plans a capped source's next wave from the
  previous one's results).
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from tasks.config import RayConfig
from tasks.core.ray_utils import cluster_cpus, init_ray
from tasks.core.resume import MANIFEST, JobStore, remove_temp_files, verify_manifest, write_manifest


def start_ray(cfg: RayConfig | None) -> int:
    """Start or attach Ray (`init_ray`); the number of CPUs it can schedule on."""
    init_ray(cfg)
    return cluster_cpus()


def clear_stale_output(out_dir: Path) -> None:
    """Remove what an earlier run left in `out_dir` before new output is written: the manifest
    first (so a kill never leaves a stale one), the shards, hidden temp files."""
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for stale in out_dir.glob("shard-*.parquet"):
        stale.unlink()
    remove_temp_files(out_dir)


class ResumableOutput:
    """A resumable stage's output directory: `_parts` (finished jobs), merged files, `manifest.json`."""

    def __init__(self, out_dir: Path, run_key: str, side_files: list[str]):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_key, self.side_files = run_key, side_files
        self.parts_dir = self.dir / "_parts"
        self.manifest = self.dir / MANIFEST

    def completed(self, started: float) -> dict | None:
        """The summary of a complete earlier run with this key (manifest and files verified), else None."""
        m = verify_manifest(self.dir, self.run_key)
        if m is None:
            return None
        return {**m["summary"], "resumed_jobs": m["summary"].get("jobs", 0), "resumed_complete": True,
                "seconds": round(time.perf_counter() - started, 3)}

    def start(self, resume: bool) -> JobStore:
        """Invalidate the old output; the store of finished jobs (emptied unless `resume`)."""
        clear_stale_output(self.dir)
        if not resume:
            shutil.rmtree(self.parts_dir, ignore_errors=True)
        self.parts_dir.mkdir(exist_ok=True)
        remove_temp_files(self.parts_dir)
        return JobStore(self.parts_dir)

    def publish(self, summary: dict) -> None:
        """Write the manifest (`summary` with its shards and the side files) last, then drop `_parts`."""
        write_manifest(self.dir, self.run_key, summary, summary["shards"], self.side_files)
        shutil.rmtree(self.parts_dir, ignore_errors=True)


@dataclass(frozen=True)
class Job:
    name: str  # unique in its run; the prefix of its part files and the name of its stored result
    key: str | None  # digest of everything the job's output depends on; None: not stored
    args: tuple  # the worker's arguments


class RayTasks:
    """Each job runs as a Ray task of `fn(*job.args)`."""

    def __init__(self, fn: Callable, ray_cfg: RayConfig | None = None):
        self.fn, self.ray_cfg = fn, ray_cfg
        self.workers = 0
        self._remote = None

    def start(self, n_jobs: int) -> None:
        import ray

        self.workers = start_ray(self.ray_cfg)
        self._remote = ray.remote(num_cpus=1)(self.fn)

    def submit(self, args: tuple):
        """The job's object ref (a task is always accepted: Ray queues it)."""
        return self._remote.remote(*args)

    def release(self, ref) -> None:
        pass

    def stop(self) -> None:
        pass


@dataclass(frozen=True)
class Shared:
    """An actor argument put into Ray's object store once, for every actor (a big index)."""
    value: Any


class RayActors:
    """Jobs run as `actor.<method>(*job.args)` on a pool of one-CPU actors of `cls(*init_args)`,
    as many as CPUs (at most one per job), each built once."""

    def __init__(self, cls: type, init_args: tuple, method: str, ray_cfg: RayConfig | None = None):
        self.cls, self.init_args, self.method, self.ray_cfg = cls, init_args, method, ray_cfg
        self.workers = 0
        self._idle: list = []
        self._busy: dict = {}  # object ref -> actor
        self._actors: list = []

    def start(self, n_jobs: int) -> None:
        import ray

        self.workers = max(1, min(start_ray(self.ray_cfg), n_jobs))
        args = [ray.put(a.value) if isinstance(a, Shared) else a for a in self.init_args]
        actor_cls = ray.remote(num_cpus=1)(self.cls)
        self._actors = [actor_cls.remote(*args) for _ in range(self.workers)]
        self._idle = list(self._actors)

    def submit(self, args: tuple):
        """The job's object ref, or None while every actor is busy."""
        if not self._idle:
            return None
        actor = self._idle.pop()
        ref = getattr(actor, self.method).remote(*args)
        self._busy[ref] = actor
        return ref

    def release(self, ref) -> None:
        self._idle.append(self._busy.pop(ref))

    def stop(self) -> None:
        import ray

        for a in self._actors:
            ray.kill(a)
        self._actors, self._idle, self._busy = [], [], {}


class JobRunner:
    """Reuse finished jobs from `store`, run the others on `workers` (started at the first job to
    run), store results as they come back. Use as a context manager (stops the workers)."""

    def __init__(self, workers: RayTasks | RayActors, store: JobStore | None = None):
        self.workers, self.store = workers, store
        self.resumed = 0
        self.ran = 0  # jobs that were run (not reused)
        self._queue: list[Job] = []
        self._pending: dict = {}  # object ref -> job
        self._started = False

    def submit(self, job: Job) -> dict | None:
        """The stored result if the job can be reused, else None: the job is queued to run."""
        if self.store is not None and job.key is not None:
            stored = self.store.load(job.name, job.key)
            if stored is not None:
                self.resumed += 1
                return stored
            for part in self.store.dir.glob(f"{job.name}-*.parquet"):  # left by a killed attempt
                part.unlink()
        self._queue.append(job)
        self.ran += 1
        return None

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._pending)

    def finished(self) -> Iterator[tuple[Job, dict]]:
        """(job, result) for each queued job, as they finish; jobs submitted meanwhile run too."""
        import ray

        while self.busy:
            self._dispatch()
            [ref], _ = ray.wait(list(self._pending), num_returns=1)
            job = self._pending.pop(ref)
            self.workers.release(ref)
            result = ray.get(ref)
            if self.store is not None and job.key is not None:
                self.store.save(job.name, job.key, result)
            yield job, result

    def _dispatch(self) -> None:
        if not self._started:
            self.workers.start(len(self._queue))
            self._started = True
        while self._queue:
            ref = self.workers.submit(self._queue[0].args)
            if ref is None:
                return
            self._pending[ref] = self._queue.pop(0)

    def __enter__(self) -> JobRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.workers.stop()
