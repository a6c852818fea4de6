"""Resumable stages: per-job results with sha256-verified parts, a manifest.

A stage splits its work into jobs (ingest: one per source file or file range; curate: one per
input row group), run by `tasks.core.executor`. Each job writes its part files atomically (temp
+ rename, see `tasks.core.documents.ShardWriter`); the driver then stores the job's result with
`JobStore.save` (atomically), together with a key (everything the
job's output depends on) and the sha256 of each part, as JSON (`<job>.json`: nothing found in a
run folder is ever unpickled). On a re-run `JobStore.load` returns the stored result only when
its signature verifies, the key matches and every part still has its sha256, so a job is either
reused whole or redone.

The merged output is written file by file atomically, then `manifest.json` last (sha256 per
output file, the run key, the summary); `verify_manifest` accepts it on a re-run only when its
signature verifies, the key matches and every file verifies.

Both records are signed with the stack's key (tasks/core/signing.py): a key is derived from the
config and inputs, which a writer of the run folder can read, so an unsigned result or manifest
written with their own parts and hashes would otherwise pass as the stage's own work. A record that
does not verify is logged as refused and the work redone. A stage killed at any point (even SIGKILL) leaves hidden
temp files (removed by `remove_temp_files`), complete parts and maybe complete shards without a
manifest, so the re-run produces byte-identical output.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tasks.core.fs import is_file, sha256 as fs_sha256
from tasks.core.hashing import sha256_file
from tasks.core.io import atomic_write_bytes
from tasks.core.signing import SignatureError, sign_record, verify_record
from tasks.core.storage import read_location

MANIFEST = "manifest.json"
JOB_SUFFIX = ".job.json"  # a finished job's stored result
JOB_PURPOSE = "job-result"
MANIFEST_PURPOSE = "stage-manifest"


def digest(obj) -> str:
    """sha256 of a JSON rendering of `obj` (keys sorted; non-JSON values by str)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def file_identity(path: str) -> list:
    """[path, size, mtime_ns] of a local file: part of a key, so a changed input is redone."""
    st = os.stat(path)
    return [path, st.st_size, st.st_mtime_ns]


def remove_temp_files(d: Path) -> None:
    """Remove the hidden temp files a killed writer left in `d` (`.<name>.tmp-<pid>`)."""
    d = Path(d)
    if d.is_dir():
        for p in d.glob(".*.tmp-*"):
            p.unlink(missing_ok=True)


# JSON with two tagged types, so job results (exact-dedup keys are bytes, MinHash signatures numpy
# arrays) round-trip without pickle; decoding builds only bytes and numeric arrays
_NUMERIC_KINDS = "biuf"


def _encode(obj):
    import base64

    import numpy as np

    if isinstance(obj, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(obj).decode()}
    if isinstance(obj, np.ndarray) and obj.dtype.kind in _NUMERIC_KINDS:
        return {"__ndarray__": base64.b64encode(np.ascontiguousarray(obj).tobytes()).decode(),
                "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"a job result holds a {type(obj).__name__}, which is not stored")


def _decode(d: dict):
    import base64

    import numpy as np

    if "__bytes__" in d:
        return base64.b64decode(d["__bytes__"])
    if "__ndarray__" in d:
        dtype = np.dtype(d["dtype"])
        if dtype.kind not in _NUMERIC_KINDS:
            raise ValueError(f"refusing to decode an array of dtype {dtype}")
        return np.frombuffer(base64.b64decode(d["__ndarray__"]), dtype=dtype).reshape(d["shape"]).copy()
    return d


def _decode_tree(obj):
    """`_decode` applied bottom-up to a parsed JSON value (what json's object_hook does while parsing)."""
    if isinstance(obj, dict):
        return _decode({k: _decode_tree(v) for k, v in obj.items()})
    if isinstance(obj, list):
        return [_decode_tree(v) for v in obj]
    return obj


class JobStore:
    """Finished jobs' results in `parts_dir`, each verified by key and part sha256 on load."""

    def __init__(self, parts_dir: Path):
        self.dir = Path(parts_dir)
        # {part: sha256} of every job saved or reused here: what the merge holds each part's bytes to
        # as it reads them (a part on the store can be replaced between this record and the merge)
        self.part_sha256: dict[str, str] = {}

    def _inside(self, part: str) -> bool:
        """Whether `part` lies in this store's folder once resolved: a part named with `..` would be
        another run's object (`RunStore.rel` resolves it), never this job's."""
        return Path(part).resolve().is_relative_to(self.dir.resolve())

    def load(self, name: str, key: str) -> dict | None:
        """The stored result of job `name` if its key matches and every part verifies, else None."""
        path = self.dir / f"{name}{JOB_SUFFIX}"
        if not path.is_file():
            return None
        try:  # the signature is checked on the plain JSON, before anything is decoded
            stored = _decode_tree(verify_record(json.loads(path.read_bytes()), JOB_PURPOSE, what=str(path)))
        except (ValueError, TypeError, KeyError):  # damaged, foreign or unsigned (SignatureError): redo the job
            return None
        if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get("part_sha256"), dict):
            return None
        for part, sha in stored["part_sha256"].items():
            if not self._inside(part):
                return None
            at, options = read_location(part)  # a part a job on another node left on the store: checked there
            if not is_file(at, options) or fs_sha256(at, options) != sha:
                return None
        self.part_sha256.update(stored["part_sha256"])
        return stored.get("result")

    def save(self, name: str, key: str, result: dict, uploaded: dict[str, str] | None = None) -> None:
        """`uploaded`: {part: sha256} of the parts a job on another node left on the store, hashed
        there as it uploaded them (read back here they would be downloaded once more)."""
        uploaded = uploaded or {}
        outside = [p for p in result.get("parts", []) if not self._inside(p)]
        if outside:
            raise ValueError(f"job {name}: parts outside {self.dir} are not recorded: {outside[:3]}")
        shas = {p: uploaded[p] if p in uploaded else sha256_file(p) for p in result.get("parts", [])}
        self.part_sha256.update(shas)
        # signed as the plain JSON it is stored as (bytes and arrays already tagged)
        body = json.loads(json.dumps({"key": key, "part_sha256": shas, "result": result}, default=_encode))
        atomic_write_bytes(self.dir / f"{name}{JOB_SUFFIX}", json.dumps(sign_record(body, JOB_PURPOSE)).encode())

    def prune(self, keep: set[str]) -> None:
        """Drop stored results of jobs that are no longer part of the run."""
        for stale in self.dir.glob(f"*{JOB_SUFFIX}"):
            if stale.name[:-len(JOB_SUFFIX)] not in keep:
                stale.unlink()


def verify_manifest(out_dir: Path, run_key: str) -> dict | None:
    """The manifest of `out_dir` if it was written for `run_key` and every listed file verifies."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        m = verify_record(json.loads(path.read_text()), MANIFEST_PURPOSE, what=str(path))
    except (ValueError, SignatureError):  # damaged or not the stage's own: redo the stage
        return None
    if m.get("key") != run_key:
        return None
    for entry in m["files"]:
        f = Path(out_dir) / entry["path"]
        if not f.is_file() or sha256_file(f) != entry["sha256"]:
            return None
    return m


def write_manifest(out_dir: Path, run_key: str, summary: dict, shards: list, side_files: list[str]) -> Path:
    """Write `manifest.json` last: sha256 and row count per Parquet shard, sha256 per side file
    (names relative to `out_dir`, listed only when present)."""
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    files = []
    for p in shards:
        files.append({"path": Path(p).name, "sha256": sha256_file(p), "docs": pq.ParquetFile(p).metadata.num_rows})
    for name in side_files:
        if (out_dir / name).is_file():
            files.append({"path": name, "sha256": sha256_file(out_dir / name)})
    path = out_dir / MANIFEST
    body = sign_record(json.loads(json.dumps({"key": run_key, "files": files, "summary": summary})), MANIFEST_PURPOSE)
    atomic_write_bytes(path, (json.dumps(body, indent=1, sort_keys=True) + "\n").encode())
    return path
