"""The object store behind a remote run_root (`run_root: s3://bucket/prefix`, any fsspec URL).

The store is the run's record; every artifact under run_root (runs, their stage outputs, the dedup
index, quality models, gate files, ...) ends up there under the same relative key. The stages keep
working on files: the driver works in a local working copy of run_root under `storage.cache_dir`
(never under the repository's runs/), and:

* `RunStore.check()` proves the bucket exists and the credentials may write to it, before anything
  is written (a missing bucket or a wrong key fails here, naming the setting, in seconds);
* `RunStore.push()` uploads what changed in the working copy since the last push (commit files such
  as manifest.json, index.json and summary.json last, so a reader of the store never sees a manifest
  before its shards) and deletes the store's copies of files removed locally. The flows push after
  every stage and at the end of a run;
* `RunStore.pull(rel)` brings a run back from the store (resume on another machine).

What other processes write to the store directly is never copied back into a working copy: training's
checkpoints are named by their URIs and every later reader (evaluation, the gate, registration,
the triggered flows on any machine) reads them there; a record another machine pushed (a triggered
flow's report) is read as the store's object (`stored`: a working-copy path's object and options).

Ray workers on other nodes never read the driver's disk: `Staging` maps a job's arguments that lie
in the working copy to the node's disk, downloading each input file from the store into the job's
own input folder, runs the job in a job directory of its own, uploads what the job wrote to the store
and hands the driver their paths and sha256s. Those files stay on the store: the driver records
them by those sha256s (the job's stored result, `tasks.core.resume.JobStore`) and reads them there
(`read_location`; the dedup stages' tasks read them through `task_location`), ingest's and the
tokens stage's merges holding each to its sha256 on the read that uses it (`fs.copy_checked`,
`fs.read_checked`: the object may be replaced after its job reported it); a stage's `_parts` on the
store go once its manifest is on the store (`remove_run_tree`). A job on the driver's own node
(local Ray) uses the working copy directly. Ray tasks outside the stages' job
runners (the dedup shuffles, a text verifier) stage nothing: they read and write the store
directly through `tasks.core.fs` (`tasks.core.executor.task_location`).

Credentials are never stored: `storage.options` holds "${ENV_VAR}" references, resolved where the
file system is made (`tasks.core.fs.filesystem`); workers resolve them in their own environment.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator
from urllib.parse import quote, unquote

from tasks.core.fs import (PathEscape, StorageError, check_store, filesystem, is_remote, protocol,  # noqa: F401 - re-exported
                           normal_uri, remove_tree, safe_join)
from tasks.core.hashing import sha256_file

log = logging.getLogger("crucible.storage")

# written last in their directory: a reader that sees one may trust the files it names
COMMIT_FILES = ("manifest.json", "index.json", "summary.json", "meta.json", ".complete")
# per working copy: what was pushed or pulled ([size, mtime_ns] or [size, mtime_ns, ETag]) by relative
# key, one file per top-level folder (a run), so that a run's many small updates never rewrite the
# records of every run under run_root
_STATE_DIR = ".crucible-store"
_LOCK = ".crucible-store.lock"


def _listed(root: Path, keys: Iterable[str]) -> dict[str, Path]:
    """The local place under `root` of each key an object-store listing gave; a key that would leave
    `root` is refused and logged, and never downloaded."""
    out = {}
    for key in keys:
        try:
            out[key] = safe_join(root, key)
        except PathEscape as e:
            log.warning("%s: the object is not downloaded", e)
    return out


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "crucible" / "store"


@dataclass(frozen=True)
class RunStore:
    """A remote run_root: its URI, the fsspec options (env references unresolved) and the local
    working copy's root."""
    root: str
    options: dict = field(default_factory=dict, hash=False, compare=False)
    cache_dir: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", self.root.rstrip("/"))
        # absolute: the stack's worker opens the registered store from another working directory
        object.__setattr__(self, "cache_dir", str(Path(self.cache_dir or default_cache_dir()).expanduser().resolve()))

    @property
    def protocol(self) -> str:
        return protocol(self.root)

    @property
    def local_root(self) -> Path:
        return Path(self.cache_dir) / self.protocol / self.root.split("://", 1)[1]

    def fs(self):
        return filesystem(self.protocol, self.options)

    def rel(self, local: str | Path) -> str | None:
        """`local`'s key relative to run_root, or None when it is not in the working copy."""
        try:
            return Path(local).resolve().relative_to(self.local_root).as_posix()
        except ValueError:
            return None

    def uri(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel and rel != "." else self.root

    def lineage_name(self, local: str | Path) -> tuple[str, str] | None:
        """(namespace, name) per the OpenLineage naming spec: ("s3://bucket", key)."""
        rel = self.rel(local)
        if rel is None:
            return None
        key = self.uri(rel).split("://", 1)[1].split("/", 1)
        return f"{self.protocol}://{key[0]}", (key[1] if len(key) > 1 else "")

    def check(self, timeout: float = 20.0, setting: str = "run_root", options_setting: str = "storage.options"
              ) -> None:
        """The bucket check of the root (`tasks.core.fs.check_store`)."""
        check_store(self.root, self.options, timeout, setting, options_setting)

    # ---- working copy <-> store ---------------------------------------------------------------
    @contextmanager
    def _state(self, keys: list[str] | None = None) -> Iterator[dict]:
        """The push record of the working copy, under an exclusive lock (flows of other processes
        share the working copy): of the top-level folders of `keys` (keys or prefixes relative to
        run_root; None or ".": all). The caller adds and removes entries under those folders only."""
        self.local_root.mkdir(parents=True, exist_ok=True)
        folder = self.local_root / _STATE_DIR
        with open(self.local_root / _LOCK, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if keys is None or any(k in ("", ".") for k in keys):
                tops = {unquote(p.stem) for p in folder.glob("*.json")}
            else:
                tops = {_top(k) for k in keys}
            state: dict = {}
            for top in tops:
                path = folder / f"{quote(top, safe='')}.json"
                if path.exists():
                    state.update(json.loads(path.read_text()))
            yield state
            _write_records(folder, state, tops)

    @contextmanager
    def exclusive(self, rel: str, setting: str, timeout: float, stale_after: float = 3600.0) -> Iterator[None]:
        """Hold the store-wide lock object `rel` for the body: created only where none exists (S3's
        conditional write, If-None-Match), deleted afterwards. One found waits (StorageError naming
        `setting` and the holder after `timeout` s); one older than `stale_after` s, left by a holder
        that died, is taken over. Writers on any machine that go through it never interleave."""
        fs, uri = self.fs(), self.uri(rel)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        unlocked = False
        deadline = time.monotonic() + timeout
        while True:
            try:
                fs.pipe_file(uri, json.dumps(me).encode(), mode="create")
                break
            except TypeError:  # a file system without conditional writes (only s3fs has `mode`)
                unlocked = True
                break
            except FileExistsError:
                try:
                    holder = json.loads(fs.cat_file(uri))
                except (FileNotFoundError, ValueError):
                    continue  # released (or half-written) meanwhile: try again
                if time.time() - float(holder.get("since", 0)) > stale_after:
                    fs.rm_file(uri)  # its holder died holding it
                    continue
                if time.monotonic() > deadline:
                    raise StorageError(f"{setting} {uri}: held since "
                                       f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(holder.get('since', 0)))} "
                                       f"UTC by pid {holder.get('pid')} on {holder.get('host')}; waited "
                                       f"{timeout:.0f} s (a lock older than {stale_after:.0f} s is taken over)") from None
                time.sleep(1.0)
        if unlocked:
            warnings.warn(f"{setting} {uri}: {self.protocol}:// has no conditional write; writers on several "
                          "machines are not kept apart", stacklevel=3)
            yield
            return
        try:
            yield
        finally:
            try:
                fs.rm_file(uri)
            except FileNotFoundError:
                pass

    def recorded(self, key: str) -> list | None:
        """What the record says of `key` (relative to run_root): [size, mtime_ns(, ETag)] or None."""
        with self._state([key]) as state:
            return state.get(key)

    def _local_files(self, under: Path) -> dict[str, os.stat_result]:
        out = {}
        for dirpath, dirs, files in os.walk(under):
            dirs[:] = [d for d in dirs if d != _STATE_DIR]
            for name in files:
                if name.startswith(".crucible-store") or name.startswith(".tmp") or name.endswith(".tmp"):
                    continue
                p = Path(dirpath) / name
                try:
                    out[p.relative_to(self.local_root).as_posix()] = p.stat()
                except FileNotFoundError:  # removed while walking (a temp file renamed)
                    continue
        return out

    def push(self, under: str | Path | None = None) -> dict:
        """Upload new and changed files of the working copy (under `under`, default all of it),
        commit files last; delete the store's copies of files this working copy pushed and has
        since removed. Returns {uploaded, deleted, bytes}."""
        base = Path(under).resolve() if under else self.local_root
        prefix = self.rel(base)
        if prefix is None:
            raise StorageError(f"{base} is not in the working copy of {self.root}")
        fs = self.fs()
        with self._state([prefix]) as state:
            if base.is_file():
                files = {prefix: base.stat()}
            else:
                files = self._local_files(base) if base.exists() else {}
            # an entry is [size, mtime_ns], with the store's ETag third for a file pulled
            changed = [rel for rel, st in files.items() if state.get(rel, [])[:2] != [st.st_size, st.st_mtime_ns]]
            changed.sort(key=lambda rel: (Path(rel).name in COMMIT_FILES, rel))
            for rel in changed:
                fs.put_file(str(self.local_root / rel), self.uri(rel))
                st = files[rel]
                state[rel] = [st.st_size, st.st_mtime_ns]
            inside = "" if prefix == "." else prefix + "/"
            gone = [rel for rel in state if (rel == prefix or rel.startswith(inside)) and rel not in files]
            for rel in sorted(gone, key=lambda r: Path(r).name not in COMMIT_FILES):  # commit files first
                try:
                    fs.rm_file(self.uri(rel))
                except FileNotFoundError:
                    pass
                del state[rel]
        return {"uploaded": len(changed), "deleted": len(gone), "bytes": sum(files[r].st_size for r in changed)}

    def pull(self, rel: str, keys: list[str] | None = None, skip: tuple[str, ...] = ()) -> int:
        """Download `keys` (relative to run_root; default every object under `rel` whose key does
        not start with one of `skip`) into the working copy, recorded as pushed. Returns the number
        of files."""
        fs = self.fs()
        etags: dict[str, str] = {}
        if keys is None:
            base = self.uri(rel)
            root_path = self.root.split("://", 1)[1]
            try:
                found = fs.find(base, detail=True)
            except FileNotFoundError:
                found = {}
            etags = {p.split("://", 1)[-1][len(root_path) + 1:]: _etag(info) for p, info in found.items()}
            etags = {k: e for k, e in etags.items() if not k.startswith(skip)}
            places = _listed(self.local_root, etags)
        else:  # named by a job's result: one that escapes is an error, not a listing's stray object
            places = {key: safe_join(self.local_root, key) for key in keys}
        keys = list(places)
        with self._state(keys or [rel]) as state:
            for key in keys:
                dest = _download(fs, self.uri(key), places[key])
                st = dest.stat()
                state[key] = [st.st_size, st.st_mtime_ns, *([etags[key]] if etags.get(key) else [])]
        return len(keys)

    def pull_run(self, layout) -> int:
        """Bring back a run another machine started (`layout`: its `tasks.core.layout.RunLayout`)
        to resume it here: all but its checkpoints, which stay on the store, where training and
        every reader take them by URI (a pull would download every step). Returns the files."""
        return self.pull(self.rel(layout.run_dir), skip=(f"{self.rel(layout.checkpoints_dir)}/",))


def _top(key: str) -> str:
    return key.split("/", 1)[0]


def _write_records(folder: Path, state: dict, tops: set[str]) -> None:
    """`state`'s entries, a file per top-level folder of `tops` and of its keys (none left: removed)."""
    by_top: dict[str, dict] = {}
    for key, entry in state.items():
        by_top.setdefault(_top(key), {})[key] = entry
    folder.mkdir(exist_ok=True)
    for top in tops | set(by_top):
        path = folder / f"{quote(top, safe='')}.json"
        if top not in by_top:
            path.unlink(missing_ok=True)
            continue
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(by_top[top]))
        os.replace(tmp, path)


def _etag(info: dict) -> str:
    return str(info.get("ETag") or info.get("etag") or "")


# ---- the stores of this process ------------------------------------------------------------------
_STORES: dict[str, RunStore] = {}


def open_store(run_root: str, options: dict | None = None, cache_dir: str | None = None,
               check_timeout: float | None = None) -> RunStore:
    """The store of a remote run_root, registered for this process (checked first when
    `check_timeout` is given)."""
    store = RunStore(run_root, dict(options or {}), cache_dir or "")
    if check_timeout is not None:
        store.check(check_timeout)
    _STORES[store.root] = store
    return store


def store_for(cfg, check: bool = False) -> RunStore | None:
    """The store of `cfg.run_root` (None for a local run_root), registered for this process."""
    if not is_remote(cfg.run_root):
        return None
    known = _STORES.get(cfg.run_root.rstrip("/"))
    if known is not None and not check:
        return known
    s = cfg.storage
    return open_store(cfg.run_root, s.options, s.cache_dir, s.check_timeout if check else None)


def local_run_root(cfg) -> Path:
    """Where the stages read and write `cfg.run_root`: itself when local, else its working copy."""
    store = store_for(cfg)
    return store.local_root if store is not None else Path(cfg.run_root).expanduser().resolve()


def local_root_of(run_root: str | Path) -> Path:
    """`local_run_root` for a run_root given as a string (a remote one must be registered)."""
    if not is_remote(run_root):
        return Path(run_root).expanduser().resolve()
    store = _STORES.get(str(run_root).rstrip("/"))
    if store is None:
        raise StorageError(f"run_root {run_root}: its store is not open in this process (tasks.core.storage.store_for)")
    return store.local_root


def store_of_path(path: str | Path) -> RunStore | None:
    """The registered store whose working copy holds `path`."""
    for store in _STORES.values():
        if store.rel(path) is not None:
            return store
    return None


def lineage_name(path: str | Path) -> tuple[str, str] | None:
    """(namespace, name) of a working-copy path as the OpenLineage naming spec names its object
    ("s3://bucket", key); None for a path of no store."""
    store = store_of_path(path)
    return store.lineage_name(path) if store is not None else None


def uri_lineage_name(uri: str) -> tuple[str, str]:
    """(namespace, name) of an object-store URI: ("s3://bucket", key)."""
    proto, rest = uri.split("://", 1)
    bucket, _, key = rest.partition("/")
    return f"{proto}://{bucket}", key


def run_uri(path: str | Path) -> str | None:
    """The store URI of a working-copy path (None for a local run_root)."""
    store = store_of_path(path)
    return store.uri(store.rel(path)) if store is not None else None


def store_holding(uri: str, stores: Iterable[RunStore] | None = None) -> RunStore | None:
    """The store among `stores` (default: those open in this process) whose root holds the URI."""
    return next((s for s in (_STORES.values() if stores is None else stores)
                 if uri == s.root or uri.startswith(s.root + "/")), None)


def stored(path: str | Path) -> tuple[Path | str, dict | None]:
    """Where a run file is read, with the fsspec options to read it: a path in a store's working
    copy is read as the store's object (other processes and machines write there: what this copy
    holds may be stale or absent), any other path as itself. A URI is returned as given."""
    if is_remote(path):
        store = store_holding(str(path))
        return str(path), store.options if store is not None else None
    store = store_of_path(path)
    if store is None:
        return Path(path), None
    return store.uri(store.rel(path)), store.options


def read_location(path: str | Path) -> tuple[Path | str, dict | None]:
    """Where the driver reads a run file: the file itself when this working copy holds it, else
    (a store run's file that a job on another node wrote, `left_on_store`) the store's object."""
    if not is_remote(path) and Path(path).is_file():
        return Path(path), None
    return stored(path)


def remove_run_tree(path: str | Path) -> None:
    """Delete the folder `path` here and, in a store's working copy, the store's objects under it
    (what jobs on other nodes wrote there never came into this copy)."""
    shutil.rmtree(path, ignore_errors=True)
    at, options = stored(path)
    if is_remote(at):
        remove_tree(at, options)


def local_place(uri: str) -> Path:
    """The place in the working copy of an object of a registered store (where this process writes
    what belongs beside it: a run's reports and gate files); StorageError for a URI of no open store,
    PathEscape for a key with `..` or not in normal form (`fs.normal_uri`: `r1//train/...` is another
    object than `r1/train/...`, yet would get its place)."""
    normal_uri(uri)
    store = store_holding(uri)
    if store is None:
        raise StorageError(f"{uri}: no store open in this process holds it (tasks.core.storage.store_for)")
    return safe_join(store.local_root, uri[len(store.root) + 1:]) if uri != store.root else store.local_root


def push_path(path: str | Path) -> dict | None:
    """Push the working copy under `path` when it belongs to a store (no-op for local run roots)."""
    store = store_of_path(path)
    return store.push(path) if store is not None else None


# ---- a node's read-through cache (training's token files, `tasks.train.remote`) -------------------
@dataclass(frozen=True)
class CacheBound:
    """How large a node's cache may grow (StorageConfig.node_cache_gb) and how long a file is safe
    from pruning after its last use (StorageConfig.cache_min_age_s)."""
    max_bytes: int = 50 << 30
    min_age_s: float = 3600.0

    @classmethod
    def of(cls, storage) -> "CacheBound":
        return cls(int(storage.node_cache_gb * (1 << 30)), storage.cache_min_age_s)


_PRUNED: dict[str, float] = {}  # cache folder -> when this process last pruned it
PRUNE_EVERY_S = 60.0


def prune_cache(folder: Path, bound: CacheBound, force: bool = False, keep: Iterable[Path] = ()) -> dict:
    """Delete the least recently used files under `folder` (by mtime: a cache hit touches its file)
    until it holds at most 80 % of bound.max_bytes, once it holds more than bound.max_bytes; files
    used within bound.min_age_s, and `keep`, stay whatever the size. At most once a minute per folder
    and process unless `force`. Returns {files, bytes, removed, removed_bytes}."""
    now = time.time()
    if not force and now - _PRUNED.get(str(folder), 0.0) < PRUNE_EVERY_S:
        return {}
    keep = set(keep)
    _PRUNED[str(folder)] = now
    entries = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            p = Path(dirpath) / name
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
    total = sum(e[1] for e in entries)
    stats = {"files": len(entries), "bytes": total, "removed": 0, "removed_bytes": 0}
    if total <= bound.max_bytes:
        return stats
    target = int(bound.max_bytes * 0.8)
    for mtime, size, p in sorted(entries):
        if total <= target or now - mtime < bound.min_age_s:
            break
        if p in keep:
            continue
        p.unlink(missing_ok=True)
        total -= size
        stats["removed"] += 1
        stats["removed_bytes"] += size
    return stats


def touch(path: Path) -> None:
    """Mark a cached file used now (what prune_cache orders by)."""
    try:
        os.utime(path)
    except FileNotFoundError:
        pass


# ---- Ray jobs on other nodes ---------------------------------------------------------------------
def node_root(node_id: str) -> Path:
    """Where a Ray node stages its jobs' files (a folder per job, its inputs beside it)."""
    return Path(tempfile.gettempdir()) / "crucible-stage" / node_id[:16]


def map_paths(obj: Any, fn, options: dict | None = None) -> Any:
    """`obj` with `fn` applied to every path (str or Path) in it, through lists, tuples, dicts and
    objects that name files themselves: `obj.stage_paths(f, options)` gives a copy with its paths
    mapped by `f` (a text verifier reading Parquet files), read with the fsspec `options` when
    they are given (its paths become a store's URIs)."""
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_paths(o, fn, options) for o in obj)
    if isinstance(obj, dict):
        return {k: map_paths(v, fn, options) for k, v in obj.items()}
    if isinstance(obj, (str, Path)):
        return fn(obj)
    if hasattr(obj, "stage_paths"):
        return obj.stage_paths(lambda v: map_paths(v, fn, options), options)
    return obj


@dataclass(frozen=True)
class Staging:
    """What a Ray job needs to stage its files through the stores: the stores, and the driver's node
    (whose jobs use the working copy directly)."""
    stores: tuple[RunStore, ...]
    driver_node: str

    @classmethod
    def for_driver(cls) -> "Staging | None":
        """The staging of this driver's jobs: None without a store."""
        if not _STORES:
            return None
        from tasks.core.ray_utils import current_node_id

        return cls(tuple(_STORES.values()), current_node_id())

    def _owner(self, path: str) -> tuple[RunStore, str] | None:
        for store in self.stores:
            root = str(store.local_root)
            if path == root or path.startswith(root + "/"):
                return store, path[len(root) + 1:]
        return None

    def stage_in(self, obj: Any, job_dir: Path, back: dict[str, str]) -> Any:
        """`obj` (`map_paths`' values) with each working-copy path replaced by the node's: an object
        in the store is downloaded into the job's own input folder (removed with the job: no node
        cache, which saved ~10-25 ms a curate job on moto, well under 1 % of its time); any other path
        is an output location inside `job_dir`. `back` collects node path -> driver path."""
        done: dict[str, Any] = {}  # a path named many times (a shard per row group) is looked up once

        def stage(p: str | Path) -> Any:
            if str(p) not in done:
                done[str(p)] = self._stage_path(p, job_dir, back)
            return done[str(p)]

        return map_paths(obj, stage)

    def _stage_path(self, p: str | Path, job_dir: Path, back: dict[str, str]) -> Any:
        owned = self._owner(str(p))
        if owned is None:
            return p
        store, rel = owned
        safe_join(store.local_root, rel)  # a working-copy path with '..' names no object of the store
        fs = store.fs()
        uri = store.uri(rel)
        info = _info(fs, uri)
        if info is not None and info.get("type") == "file":
            node_path = _download(fs, uri, _inputs_of(job_dir) / _store_key(store) / rel)
        else:
            node_path = job_dir / _store_key(store) / rel
            node_path.parent.mkdir(parents=True, exist_ok=True)
        back[str(node_path)] = str(p)
        return type(p)(node_path) if isinstance(p, Path) else str(node_path)

    def stage_out(self, job_dir: Path) -> dict[str, str]:
        """Upload every file the job wrote under `job_dir`, commit files last; {its path in the
        driver's working copy: sha256 of the bytes uploaded} (what the driver records of a job's
        parts without reading them back)."""
        out = {}
        by_key = {_store_key(s): s for s in self.stores}
        for p in sorted(job_dir.rglob("*"), key=lambda q: (q.name in COMMIT_FILES, str(q))):
            if not p.is_file() or p.name.startswith(".tmp") or p.name.endswith(".tmp"):
                continue
            skey, rel = p.relative_to(job_dir).as_posix().split("/", 1)
            store = by_key[skey]
            sha = sha256_file(p)
            store.fs().put_file(str(p), store.uri(rel))
            out[str(safe_join(store.local_root, rel))] = sha
        return out

    def run(self, fn, args: tuple, node_id: str) -> tuple[Any, dict[str, str]]:
        """fn(*args) on this node with its files staged; (result with driver paths, {driver path:
        sha256} of the files it wrote, which stay on the store: `left_on_store`). On the driver's
        node a job uses the working copy directly."""
        if node_id == self.driver_node:
            return fn(*args), {}
        job_dir = node_root(node_id) / "jobs" / uuid.uuid4().hex
        back: dict[str, str] = {}
        try:
            staged = self.stage_in(args, job_dir, back)
            result = fn(*staged)
            written = self.stage_out(job_dir) if job_dir.exists() else {}
        finally:
            shutil.rmtree(job_dir, ignore_errors=True)
            shutil.rmtree(_inputs_of(job_dir), ignore_errors=True)
        return _replace_paths(result, back), written


def left_on_store(written: Iterable[str]) -> None:
    """On the driver: the working-copy paths of files a job on another node wrote to the store,
    which stay there (nothing is downloaded; readers take them where they are, `read_location`):
    this copy's own files of those names (an earlier attempt's) are removed and forgotten, so a
    reader never takes them for the job's and a push neither uploads nor deletes the store's."""
    by_store: dict[str, tuple[RunStore, list[str]]] = {}
    for path in written:
        store = store_of_path(path)
        if store is not None:
            by_store.setdefault(store.root, (store, []))[1].append(store.rel(path))
    for store, keys in by_store.values():
        with store._state(keys) as state:
            for key in keys:
                (store.local_root / key).unlink(missing_ok=True)
                state.pop(key, None)


def _store_key(store: RunStore) -> str:
    return hashlib.sha256(store.root.encode()).hexdigest()[:12]


def _inputs_of(job_dir: Path) -> Path:
    """A job's inputs: beside its job folder, whose files are all uploaded."""
    return job_dir.with_name(job_dir.name + ".in")


def _info(fs, uri: str) -> dict | None:
    try:
        return fs.info(uri)
    except FileNotFoundError:
        return None


def _download(fs, uri: str, dest: Path) -> Path:
    """`uri` at `dest`, whole or not at all (a temporary file beside it, renamed)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".tmp-{uuid.uuid4().hex}-{dest.name}")
    try:
        fs.get_file(uri, str(tmp))
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _replace_paths(obj: Any, back: dict[str, str]) -> Any:
    """`obj` with every string that starts with a node path rewritten to its driver path."""
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace_paths(o, back) for o in obj)
    if isinstance(obj, dict):
        return {k: _replace_paths(v, back) for k, v in obj.items()}
    if isinstance(obj, (str, Path)):
        s = str(obj)
        for node, driver in back.items():
            if s == node or s.startswith(node + "/") or s.startswith(node + "."):
                s = driver + s[len(node):]
                return type(obj)(s) if isinstance(obj, Path) else s
    return obj


# ---- other locations on a store -------------------------------------------------------------------
def store_for_uri(uri: str, setting: str, check_timeout: float = 20.0, storage=None) -> tuple[RunStore, str]:
    """(store, key relative to its root) of an object-store URI named by a setting other than
    run_root (the MinHash index): the registered store whose root holds it (run_root's: one working
    copy, checked by the flow), else a new store rooted at the URI with the options and cache of a
    registered store of the same protocol (none: the AWS chain), checked first; a store that cannot
    be used raises StorageError naming `setting`. `storage` (a StorageConfig): its options and cache
    instead, for a run whose run_root is local."""
    uri = uri.rstrip("/")
    if (store := store_holding(uri)) is not None:
        return store, uri[len(store.root) + 1:] or "."
    like = storage or next((s for s in _STORES.values() if s.protocol == protocol(uri)), None)
    store = RunStore(uri, dict(like.options) if like else {}, (like.cache_dir or "") if like else "")
    store.check(check_timeout, setting=setting)
    _STORES[store.root] = store
    return store, "."
