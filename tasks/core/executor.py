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

On a cluster a node may die mid-stage: a task is retried by Ray (`TASK_RETRIES`); a job whose
actor died with its node is run again on a surviving actor (`JOB_ATTEMPTS` in all). Jobs write
their parts atomically under fixed names, so a repeated job leaves the same output. Each result
comes back with the id of the node that ran it and the seconds its body took there;
`JobRunner.nodes` counts jobs per node, what the stage summaries report as `nodes`
(`JobRunner.node_report`), and `JobRunner.job_report` says where a stage's time on Ray went
(compute in the jobs vs the map's wall time on its workers, and the bytes of results moved).

Ray tasks outside a JobRunner (the dedup shuffles, `tasks.dedup.cluster` and `tasks.dedup.lines`,
and curate's dedup stages, `tasks.dedup.stages`) read and write the store directly where their
nodes do not share the driver's disk (`task_location`, `for_any_node`).
"""
from __future__ import annotations

import bisect
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from tasks.config import RayConfig
from tasks.core.ray_utils import cluster_cpus, current_node_id, init_ray, tasks_per_node
from tasks.core.resume import MANIFEST, JobStore, remove_temp_files, verify_manifest, write_manifest
from tasks.core.storage import (Staging, left_on_store, map_paths, node_root, push_path, remove_run_tree,
                                 store_of_path)


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


PARTS_DIR = "_parts"  # a ResumableOutput's finished jobs (and a stage's work files before it starts)


class ResumableOutput:
    """A resumable stage's output directory: `_parts` (finished jobs), merged files, `manifest.json`."""

    def __init__(self, out_dir: Path, run_key: str, side_files: list[str]):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_key, self.side_files = run_key, side_files
        self.parts_dir = self.dir / PARTS_DIR
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
        if not resume:  # the store's too: parts and job records jobs on other nodes left there only
            remove_run_tree(self.parts_dir)
        self.parts_dir.mkdir(exist_ok=True)
        remove_temp_files(self.parts_dir)
        return JobStore(self.parts_dir)

    def publish(self, summary: dict) -> None:
        """Write the manifest (`summary` with its shards and the side files) last, then drop `_parts`.
        On a store run the stage's folder is pushed (the manifest last) before the store's `_parts`
        go (jobs on other nodes wrote their parts there only): a reader of the store finds the
        finished jobs or the manifest, never neither."""
        write_manifest(self.dir, self.run_key, summary, summary["shards"], self.side_files)
        shutil.rmtree(self.parts_dir, ignore_errors=True)
        push_path(self.dir)
        remove_run_tree(self.parts_dir)


@dataclass(frozen=True)
class Job:
    name: str  # unique in its run; the prefix of its part files and the name of its stored result
    key: str | None  # digest of everything the job's output depends on; None: not stored
    args: tuple  # the worker's arguments


TASK_RETRIES = 3  # Ray re-runs a task whose worker or node died (its default, stated)
JOB_ATTEMPTS = 3  # runs of one job on actors before a lost actor fails the stage


def _timed_on_node(fn: Callable, args: tuple, staging: Staging | None) -> tuple[Any, str, float, dict]:
    """(fn(*args), id of the node it ran on, seconds it took, {path: sha256} of the files it left on
    the store): what every job returns. With a remote run_root (`staging`), a job on another node
    than the driver's reads its inputs from the store and writes its outputs there
    (`tasks.core.storage.Staging`)."""
    t0 = time.perf_counter()
    node = current_node_id()
    if staging is None:
        return fn(*args), node, time.perf_counter() - t0, {}
    result, written = staging.run(fn, args, node)
    return result, node, time.perf_counter() - t0, written


def _reporting_node(fn: Callable, staging: Staging | None) -> Callable:
    """`fn` as a Ray task body that returns `_timed_on_node`'s tuple."""
    def run(*args):
        return _timed_on_node(fn, args, staging)

    run.__name__ = run.__qualname__ = getattr(fn, "__name__", "job")
    return run


def _node_reporting_class(cls: type, staging: Staging | None) -> type:
    """`cls` with `run_job(method, *args)`: `_timed_on_node`'s tuple for the method. Its init
    arguments are staged in from the store on a node other than the driver's (model files).
    Created with `warm=(...)` (`RayActors.prestart`), the actor first runs `cls.warm_up(*warm)`
    and builds `cls` only when `_reporting_build(*init_args)` comes (a name of the wrapper's own,
    not to hide a `build` of `cls`); a build error is raised by its jobs; a failed warm-up is
    dropped (the build loads the same things, and fails there if it must)."""
    class NodeReporting(cls):
        def __init__(self, *args, warm: tuple | None = None):
            self._build_error: BaseException | None = None
            if warm is not None:
                try:
                    cls.warm_up(*warm)
                except Exception:  # noqa: BLE001 - only a head start: the build does the same work
                    pass
                return
            self._reporting_build(*args)

        def _reporting_build(self, *args) -> None:
            self._build_error = None
            node = current_node_id()
            if staging is not None and node != staging.driver_node:  # model files: into <node>/init.in, shared
                args = staging.stage_in(args, node_root(node) / "init", {})
            try:
                super().__init__(*args)
            except Exception as e:  # noqa: BLE001 - raised again by each job, where the stage sees it
                self._build_error = e

        def run_job(self, method: str, *args):
            if self._build_error is not None:
                raise self._build_error
            return _timed_on_node(getattr(self, method), args, staging)

    NodeReporting.__name__ = NodeReporting.__qualname__ = cls.__name__
    return NodeReporting


def task_location(path: str | Path) -> tuple[Path | str, dict | None]:
    """(where a Ray task on any node reads or writes `path`, the fsspec options to do it with):
    the path itself when every task shares this driver's disk (a local run_root, or a Ray of this
    node alone), else, for a path in a remote run_root's working copy, its object URI on the store
    and the store's options (their "${ENV}" references resolved by the task, in its own
    environment). Spill files between the phases of a shuffle go there directly, as datatrove's
    steps pass files on a DataFolder."""
    from tasks.core.ray_utils import only_this_node

    store = store_of_path(path)
    if store is None or only_this_node():
        return Path(path), None
    return store.uri(store.rel(path)), store.options


def for_any_node(obj: Any) -> tuple[Any, dict | None]:
    """(`obj` as a Ray task on any node reads it, the store's options): `task_location` applied to
    every path `map_paths` finds in `obj` (lists, dicts, a text verifier's part files); the
    folders of working-copy files named are pushed first, so their objects are there to read."""
    from tasks.core.ray_utils import only_this_node

    if only_this_node():
        return obj, None
    stores: dict[str, Any] = {}
    folders: set[str] = set()

    def note(p):
        if (store := store_of_path(p)) is not None:
            stores[store.root] = store
            folders.add(str(Path(p).parent))
        return p

    map_paths(obj, note)
    if not stores:
        return obj, None
    if len(stores) > 1:
        raise ValueError(f"a task's inputs lie in several stores ({', '.join(stores)}): it has one set of options")
    store = next(iter(stores.values()))
    for folder in sorted(folders):
        store.push(folder)

    def to_uri(p):
        rel = store.rel(p)
        return p if rel is None else store.uri(rel)

    return map_paths(obj, to_uri, store.options), store.options


def _lost_worker_errors() -> tuple[type, ...]:
    """What a call on an actor raises when its process or node is gone (not the job's own error)."""
    from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError

    return RayActorError, ObjectLostError, NodeDiedError


class RayTasks:
    """Each job runs as a Ray task of `fn(*job.args)`."""

    recovers_lost_workers = False  # Ray itself retries a task whose node died

    def __init__(self, fn: Callable, ray_cfg: RayConfig | None = None):
        self.fn, self.ray_cfg = fn, ray_cfg
        self.workers = 0
        self._remote = None

    def start(self, n_jobs: int) -> None:
        import ray

        self.workers = start_ray(self.ray_cfg)
        self._remote = ray.remote(num_cpus=1, max_retries=TASK_RETRIES)(_reporting_node(self.fn, Staging.for_driver()))

    def submit(self, args: tuple):
        """The job's object ref (a task is always accepted: Ray queues it)."""
        return self._remote.remote(*args)

    def release(self, ref) -> None:
        pass

    def lost(self, ref) -> None:
        pass

    def stop(self) -> None:
        pass


@dataclass(frozen=True)
class Shared:
    """An actor argument put into Ray's object store once, for every actor (a big index)."""
    value: Any


class RayActors:
    """Jobs run as `actor.<method>(*job.args)` on a pool of one-CPU actors of `cls(*init_args)`,
    as many as CPUs (at most one per job), each built once. An actor lost with its node is
    dropped; its job goes to the others (a new actor is started only when none is left).

    `prestart(n_jobs, *warm)` starts the actors before their init arguments exist (a stage still
    building an index): each boots its process and runs `cls.warm_up(*warm)` (imports, models)
    while the driver works, and is built with `init_args` (set by then) when the jobs start. A new
    worker process's start-up and a first job's model loading are otherwise the map's first
    seconds with every CPU idle."""

    recovers_lost_workers = True

    def __init__(self, cls: type, init_args: tuple, method: str, ray_cfg: RayConfig | None = None):
        self.cls, self.init_args, self.method, self.ray_cfg = cls, init_args, method, ray_cfg
        self.workers = 0
        self.prestarted = 0  # actors started by `prestart` (warmed up before their jobs)
        self._idle: list = []
        self._busy: dict = {}  # object ref -> actor
        self._actors: list = []
        self._args: list = []  # init_args with each Shared value put once
        self._actor_cls = None

    def _define(self, n_jobs: int) -> None:
        import ray

        self.workers = max(1, min(start_ray(self.ray_cfg), n_jobs))
        self._actor_cls = ray.remote(num_cpus=1)(_node_reporting_class(self.cls, Staging.for_driver()))

    def prestart(self, n_jobs: int, *warm) -> None:
        """Start the actors now, each running `cls.warm_up(*warm)`; built at `start`.

        Rule: nothing between `prestart` and `start` may wait on Ray work that needs a CPU (tasks,
        other actors): the actors hold min(CPUs, n_jobs) CPUs from now on, so on a cluster of
        no more CPUs than jobs such work is never scheduled and its `ray.get` waits forever. Run
        it before `prestart` (curate counts lines on Ray first), or in the driver."""
        if n_jobs < 1 or self._actors:
            return
        self._define(n_jobs)
        self._actors = [self._actor_cls.remote(warm=warm) for _ in range(self.workers)]
        self.prestarted = len(self._actors)

    def start(self, n_jobs: int) -> None:
        import ray

        if not self._actors:
            self._define(n_jobs)
        self._args = [ray.put(a.value) if isinstance(a, Shared) else a for a in self.init_args]
        if self._actors and self.prestarted:  # each actor runs its calls in order: built before its first job
            for actor in self._actors:
                actor._reporting_build.remote(*self._args)
        else:  # cold (also a pool started again after `stop`)
            self.prestarted = 0
            self._actors = [self._actor_cls.remote(*self._args) for _ in range(self.workers)]
        self._idle = list(self._actors)

    def submit(self, args: tuple):
        """The job's object ref, or None while every actor is busy."""
        if not self._idle:
            return None
        actor = self._idle.pop()
        ref = actor.run_job.remote(self.method, *args)
        self._busy[ref] = actor
        return ref

    def release(self, ref) -> None:
        self._idle.append(self._busy.pop(ref))

    def lost(self, ref) -> None:
        """The actor of `ref` died (its node did): drop it; start a new one only if none is left."""
        import ray

        actor = self._busy.pop(ref)
        self._actors.remove(actor)
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone is what we expect
            pass
        if not self._actors:  # scheduled as soon as a node has a free CPU
            self._actors = [self._actor_cls.remote(*self._args)]
            self._idle = list(self._actors)

    def stop(self) -> None:
        import ray

        for a in self._actors:
            ray.kill(a)
        self._actors, self._idle, self._busy = [], [], {}


def _result_size(ref) -> tuple[int, bool]:
    """(bytes of a finished job's result, whether it sits in the object store rather than inline
    with the reply): the owner's record, one local call."""
    import ray

    try:
        loc = ray.experimental.get_object_locations([ref]).get(ref) or {}
    except Exception:  # noqa: BLE001 - a figure for the report; a Ray Client (ray://) driver has no record
        return 0, False
    return int(loc.get("object_size") or 0), bool(loc.get("node_ids"))


class JobRunner:
    """Reuse finished jobs from `store`, run the others on `workers` (started at the first job to
    run), store results as they come back. Use as a context manager (stops the workers)."""

    def __init__(self, workers: RayTasks | RayActors, store: JobStore | None = None):
        self.workers, self.store = workers, store
        self.resumed = 0
        self.ran = 0  # jobs that were run (not reused)
        self.nodes: Counter = Counter()  # node id -> jobs that node ran
        self.rerun = 0  # jobs run again after their actor was lost with its node
        self.compute_s = 0.0  # seconds in the jobs' bodies, summed over the jobs run
        self.result_bytes = [0, 0]  # of the results: all, and those that came through the object store
        self._first_dispatch = self._last_result = 0.0
        self._attempts: Counter = Counter()  # job name -> runs lost so far
        self._queue: list[Job] = []
        self._pending: dict = {}  # object ref -> job
        self._started = False
        self._leftovers: list[str] | None = None  # the store's part files when first needed, sorted
        # {path: sha256} of the files jobs on other nodes left on the store, as they hashed them on
        # upload: what a merge holds them to (a runner without a JobStore keeps no other record)
        self.written: dict[str, str] = {}

    def _remove_leftover_parts(self, name: str) -> None:
        """Delete the part files `<name>-*.parquet` a killed attempt left: the store's folder is listed
        once (sorted) and each job's files found by bisection, not one glob of the folder per job."""
        if self._leftovers is None:
            self._leftovers = sorted(p.name for p in self.store.dir.iterdir() if p.name.endswith(".parquet"))
        prefix = f"{name}-"
        for k in range(bisect.bisect_left(self._leftovers, prefix), len(self._leftovers)):
            if not self._leftovers[k].startswith(prefix):
                break
            (self.store.dir / self._leftovers[k]).unlink(missing_ok=True)

    def submit(self, job: Job) -> dict | None:
        """The stored result if the job can be reused, else None: the job is queued to run."""
        if self.store is not None and job.key is not None:
            stored = self.store.load(job.name, job.key)
            if stored is not None:
                self.resumed += 1
                return stored
            self._remove_leftover_parts(job.name)
        self._queue.append(job)
        self.ran += 1
        return None

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._pending)

    @property
    def queued(self) -> int:
        """Jobs submitted that wait for a worker (a caller planning jobs lazily keeps this short)."""
        return len(self._queue)

    def finished(self) -> Iterator[tuple[Job, dict]]:
        """(job, result) for each queued job, as they finish; jobs submitted meanwhile run too."""
        import ray

        while self.busy:
            self._dispatch()
            [ref], _ = ray.wait(list(self._pending), num_returns=1)
            job = self._pending.pop(ref)
            try:
                result, node, seconds, written = ray.get(ref)
            except _lost_worker_errors() as e:
                if not self.workers.recovers_lost_workers:
                    raise
                self._requeue(job, ref, e)
                continue
            self.workers.release(ref)
            if written:  # files a job on another node put in the store: read there, never downloaded
                left_on_store(written)
                self.written.update(written)
            self.nodes[node] += 1
            self.compute_s += seconds
            size = _result_size(ref)
            self.result_bytes[0] += size[0]
            self.result_bytes[1] += size[0] if size[1] else 0
            self._last_result = time.perf_counter()
            if self.store is not None and job.key is not None:
                self.store.save(job.name, job.key, result, written)
            yield job, result

    def _requeue(self, job: Job, ref, error: Exception) -> None:
        """The worker running `job` is gone: drop it and run the job again first."""
        self.workers.lost(ref)
        self._attempts[job.name] += 1
        if self._attempts[job.name] >= JOB_ATTEMPTS:
            raise RuntimeError(f"job {job.name}: its worker was lost {JOB_ATTEMPTS} times") from error
        self.rerun += 1
        self._queue.insert(0, job)

    def node_report(self) -> dict[str, int]:
        """{node label: jobs run there} (`tasks.core.ray_utils.tasks_per_node`)."""
        return tasks_per_node(self.nodes)

    def job_report(self) -> dict:
        """Where the jobs' time went: `map_wall_s` from the workers' start (for prestarted workers,
        `RayActors.prestart`: from their build, their process start and warm-up lie before it) to
        the last result, `compute_s` summed in the jobs' bodies, `idle_share` of the workers' time
        in that span not in a body (start-up of cold workers, building, scheduling, transfers,
        waiting for the last jobs; a prestarted worker's start-up is not in it), the workers
        prestarted, and the bytes of results moved to the driver (`via_object_store`: too big to
        come inline with the reply)."""
        wall = max(0.0, self._last_result - self._first_dispatch)
        capacity = wall * max(1, self.workers.workers)
        return {"jobs_run": sum(self.nodes.values()), "workers": self.workers.workers,
                "workers_prestarted": getattr(self.workers, "prestarted", 0),
                "map_wall_s": round(wall, 3), "compute_s": round(self.compute_s, 3),
                "idle_share": round(1 - self.compute_s / capacity, 4) if capacity > 0 else None,
                "result_bytes": self.result_bytes[0], "result_bytes_via_object_store": self.result_bytes[1]}

    def _dispatch(self) -> None:
        if not self._started:
            self._first_dispatch = time.perf_counter()
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
