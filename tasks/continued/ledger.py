"""The data ledger: every raw file that a continued-pretraining cycle consumed, in SQLite.

A cycle (1) `Ledger.discover`s, for each configured source, the files the ledger has not seen
or whose content changed since a committed cycle consumed them; (2) records them with
`pending(cycle, files)`; (3) once its model is registered, `commit(cycle)`s them in one
transaction, or `reject(cycle, reason)`s the cycle. Only committed files count as consumed: a
cycle that fails, is rejected or is SIGKILLed at any point leaves that record as it was, so the
next discovery offers the same files again.

Identity is content: sources are listed through `tasks.core.fs` (local paths and globs, file://,
s3://, http(s)://) and each file is hashed (sha256, streamed); it is new when the URI was never
consumed ("unseen") or its bytes differ from the latest version consumed ("changed"). Size and
modification time are recorded but decide nothing: anyone who can write a file can set its mtime
back, so a swapped file of the same size and mtime would pass as consumed. The one shortcut is an
object store's ETag (S3/GCS/Azure: `_ETAG_STORES`), which the store derives from the object's bytes
(S3: their MD5) or renews on every write, so an object whose size and ETag equal the consumed
version's is unchanged without being downloaded. A file merely touched keeps its consumed state.
A file that is still being written may be discovered half-written: land files by rename.

Signed: the ledger decides which raw data a cycle trains on, so its content (every row of its tables
and the schema, triggers included) is signed with the stack's key (`tasks.core.signing`, purpose
"ledger") in each write transaction, and verified before any read or write: a ledger that is
unsigned, or that anyone without the key edited (a row hiding a new file, a deleted cycle, a planted
trigger), is refused (`SignatureError`, logged "refused: ..."), never trusted.

Schema (one file, WAL journal, busy timeout, every write one BEGIN IMMEDIATE transaction, so
several processes may share it; a connection per call, so threads may too):

  cycles         cycle PK, status (pending | committed | rejected), note (why rejected, or a
                 free note on commit), started_at, ended_at
  pending_files  (cycle, uri) PK, source, size, stamp, sha256, licence, change: what a cycle
                 took; removed when it commits, kept as the record of a rejected cycle
  consumed       id PK, uri, source, size, stamp, sha256, licence, cycle, consumed_at; a URI's
                 current state is its latest row, earlier rows are the versions consumed before
  ledger_signature  the one row holding the HMAC of the rest (see "Signed")
"""
from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from tasks.config import PipelineConfig, SourceConfig
from tasks.core.fs import expand_uri, file_identity, filesystem, open_source, protocol
from tasks.core.signing import canonical, sign_bytes, verify_bytes

BUSY_TIMEOUT_S = 30.0  # a writer waits this long for another process's transaction
SIGNING_PURPOSE = "ledger"
# object stores whose ETag changes whenever the object's bytes do (a content tag, not a timestamp)
_ETAG_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS cycles (
    cycle TEXT PRIMARY KEY,
    status TEXT NOT NULL CHECK (status IN ('pending', 'committed', 'rejected')),
    note TEXT,
    started_at TEXT NOT NULL,
    ended_at TEXT
);
CREATE TABLE IF NOT EXISTS pending_files (
    cycle TEXT NOT NULL REFERENCES cycles (cycle),
    uri TEXT NOT NULL,
    source TEXT NOT NULL,
    size INTEGER,
    stamp TEXT,
    sha256 TEXT NOT NULL,
    licence TEXT NOT NULL,
    change TEXT NOT NULL,
    PRIMARY KEY (cycle, uri)
);
CREATE TABLE IF NOT EXISTS consumed (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    uri TEXT NOT NULL,
    source TEXT NOT NULL,
    size INTEGER,
    stamp TEXT,
    sha256 TEXT NOT NULL,
    licence TEXT NOT NULL,
    cycle TEXT NOT NULL REFERENCES cycles (cycle),
    consumed_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS consumed_by_uri ON consumed (uri, id);
CREATE TABLE IF NOT EXISTS ledger_signature (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    signature TEXT NOT NULL
);
"""
_SIGNED_TABLES = ("cycles", "pending_files", "consumed")
_FILE_COLUMNS = "uri, source, size, stamp, sha256, licence"


class LedgerError(RuntimeError):
    """A ledger operation that does not fit the cycle's state (e.g. committing a rejected cycle)."""


@dataclass(frozen=True)
class RawFile:
    """A raw source file as the ledger identifies it."""

    uri: str
    source: str
    size: int | None
    stamp: str | None  # mtime_ns (local) or ETag / LastModified (remote), as text: recorded, not trusted
    sha256: str
    licence: str
    change: str = "unseen"  # why it is new: "unseen" URI or "changed" content


@dataclass(frozen=True)
class ConsumedFile:
    """A file version consumed by a committed cycle."""

    uri: str
    source: str
    size: int | None
    stamp: str | None
    sha256: str
    licence: str
    cycle: str
    consumed_at: str


@dataclass(frozen=True)
class CycleRecord:
    cycle: str
    status: str  # pending | committed | rejected
    note: str | None
    started_at: str
    ended_at: str | None


@dataclass
class SourceDiscovery:
    """One source's listing compared with the ledger."""

    source: str
    uri: str  # as resolved against data_root
    listed: int
    new: list[RawFile] = field(default_factory=list)

    @property
    def unchanged(self) -> int:
        return self.listed - len(self.new)


@dataclass
class Discovery:
    """What `Ledger.discover` found: the new files per source and how many were unchanged."""

    sources: list[SourceDiscovery]

    @property
    def files(self) -> list[RawFile]:
        return [f for s in self.sources for f in s.new]

    @property
    def unchanged(self) -> int:
        return sum(s.unchanged for s in self.sources)

    @property
    def empty(self) -> bool:
        return not self.files

    @property
    def message(self) -> str:
        """One line for logs and the run's artifact: "no new data: ..." when there is nothing to do."""
        unmatched = "".join(f"; source {s.source} matched no files ({s.uri})" for s in self.sources if not s.listed)
        if self.empty:
            return (f"no new data: all {self.unchanged} files of {len(self.sources)} source(s) were consumed "
                    f"by earlier cycles{unmatched}")
        changed = sum(f.change == "changed" for f in self.files)
        per_source = ", ".join(f"{s.source} {len(s.new)}" for s in self.sources if s.new)
        return (f"{len(self.files)} new file(s) ({len(self.files) - changed} unseen, {changed} changed: "
                f"{per_source}); {self.unchanged} unchanged{unmatched}")

    def to_dict(self) -> dict:
        """JSON-serialisable form for the cycle's summary."""
        return {"message": self.message, "new_files": len(self.files), "unchanged": self.unchanged,
                "sources": {s.source: {"uri": s.uri, "listed": s.listed, "unchanged": s.unchanged,
                                       "new": [asdict(f) for f in s.new]} for s in self.sources}}


def under_state_dir(path: str | Path, state_dir: str | Path) -> Path:
    """A `continue.*` path setting: relative to the stack's state directory unless absolute."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else Path(state_dir) / path


def ledger_path(cfg: PipelineConfig, state_dir: str | Path) -> Path:
    """`continue.ledger`, relative to the stack's state directory unless absolute."""
    return under_state_dir(cfg.continue_.ledger, state_dir)


def sha256_uri(uri: str, storage_options: dict | None = None) -> str:
    """sha256 of a source file's bytes, streamed (local or remote)."""
    with open_source(uri, storage_options) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _identity(uri: str, storage_options: dict | None) -> tuple[int | None, str | None, bool]:
    """(size, change stamp, whether the stamp is a content tag): an object store's ETag is one; a
    local mtime, an HTTP validator or a LastModified is not."""
    proto = protocol(uri)
    if proto in _ETAG_STORES:
        try:
            info = filesystem(proto, storage_options).info(uri)
        except PermissionError:
            info = {}  # file_identity below raises the clear "access denied" error
        etag = info.get("ETag") or info.get("etag")
        if etag:
            return info.get("size"), str(etag), True
    _, size, stamp = file_identity(uri, storage_options)
    return size, None if stamp is None else str(stamp), False


def _identify(source: SourceConfig, uri: str, consumed: sqlite3.Row | None) -> RawFile | None:
    """`uri` as a new file of `source`, or None when its consumed version is still current (the same
    sha256, or the same size and object-store ETag) or it vanished since it was listed."""
    try:
        size, stamp, content_tag = _identity(uri, source.storage_options)
        if content_tag and consumed is not None and (consumed["size"], consumed["stamp"]) == (size, stamp):
            return None
        digest = sha256_uri(uri, source.storage_options)
    except FileNotFoundError:
        return None  # removed between listing and reading: the next discovery sees it if it returns
    if consumed is not None and consumed["sha256"] == digest:
        return None
    return RawFile(uri=uri, source=source.name, size=size, stamp=stamp, sha256=digest, licence=source.licence,
                   change="unseen" if consumed is None else "changed")


class Ledger:
    """The ledger in the SQLite file `path` (created with its schema if absent)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as conn:
            conn.execute("PRAGMA journal_mode=WAL")  # persistent: readers never block the committing writer
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                if conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0] == 0:
                    for statement in filter(str.strip, _SCHEMA.split(";")):  # a new ledger, signed at birth
                        conn.execute(statement)
                    self._sign(conn)
                else:
                    self._verify(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    @classmethod
    def for_config(cls, cfg: PipelineConfig, state_dir: str | Path) -> "Ledger":
        return cls(ledger_path(cfg, state_dir))

    # -- connections ---------------------------------------------------------------------------

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_S)
        try:
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA synchronous=FULL")  # a committed cycle survives a power cut too
            conn.execute("PRAGMA foreign_keys=ON")
            yield conn
        finally:
            conn.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, all or nothing; IMMEDIATE takes the write lock up front, so two
        processes queue (busy timeout) instead of failing half-way through. The ledger is verified
        first and signed last, inside the transaction."""
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                self._verify(conn)
                yield conn
                self._sign(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction (a consistent snapshot) of a ledger whose signature verifies."""
        with self._connect() as conn:
            conn.execute("BEGIN")
            try:
                self._verify(conn)
                yield conn
            finally:
                conn.execute("COMMIT")

    # -- signature -----------------------------------------------------------------------------

    @staticmethod
    def _digest(conn: sqlite3.Connection) -> bytes:
        """sha256 of the schema (tables, indexes, triggers, views) and every row of the signed tables."""
        h = hashlib.sha256()
        for row in conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name"):
            h.update(canonical(["schema", *row]) + b"\n")
        for table in _SIGNED_TABLES:
            for row in conn.execute(f"SELECT * FROM {table} ORDER BY rowid"):
                h.update(canonical([table, *row]) + b"\n")
        return h.hexdigest().encode()

    def _sign(self, conn: sqlite3.Connection) -> None:
        conn.execute("INSERT OR REPLACE INTO ledger_signature (id, signature) VALUES (1, ?)",
                     (sign_bytes(self._digest(conn), SIGNING_PURPOSE),))

    def _verify(self, conn: sqlite3.Connection) -> None:
        """SignatureError unless the ledger's content carries the stack's signature."""
        try:
            row = conn.execute("SELECT signature FROM ledger_signature WHERE id = 1").fetchone()
        except sqlite3.OperationalError:  # no signature table: written without signing
            row = None
        verify_bytes(self._digest(conn), row[0] if row else None, SIGNING_PURPOSE, what=f"data ledger {self.path}")

    @staticmethod
    def _status(conn: sqlite3.Connection, cycle: str) -> str | None:
        row = conn.execute("SELECT status FROM cycles WHERE cycle = ?", (cycle,)).fetchone()
        return row["status"] if row else None

    # -- discovery -----------------------------------------------------------------------------

    def discover(self, cfg: PipelineConfig) -> Discovery:
        """For each of `cfg.sources`, the listed files that no committed cycle consumed in their
        present content. Reads only; a source that matches no files is reported in the message."""
        with self._read() as conn:
            latest = {row["uri"]: row for row in conn.execute(
                "SELECT uri, size, stamp, sha256 FROM consumed"
                " WHERE id IN (SELECT MAX(id) FROM consumed GROUP BY uri)")}
        found = []
        for source in cfg.sources:
            uri = cfg.resolve_uri(source.uri)
            listed = expand_uri(uri, source.storage_options)
            new = [f for f in (_identify(source, path, latest.get(path)) for path in listed) if f is not None]
            found.append(SourceDiscovery(source=source.name, uri=uri, listed=len(listed), new=new))
        return Discovery(found)

    # -- a cycle's life ------------------------------------------------------------------------

    def pending(self, cycle: str, files: Iterable[RawFile]) -> None:
        """Record `files` as taken by `cycle`, uncommitted (replacing what the cycle recorded before).
        Nothing counts as consumed until `commit(cycle)`."""
        rows = [(cycle, f.uri, f.source, f.size, f.stamp, f.sha256, f.licence, f.change) for f in files]
        with self._transaction() as conn:
            status = self._status(conn, cycle)
            if status is None:
                conn.execute("INSERT INTO cycles (cycle, status, started_at) VALUES (?, 'pending', ?)",
                             (cycle, _now()))
            elif status != "pending":
                raise LedgerError(f"cycle {cycle!r} is already {status}: start a new cycle")
            conn.execute("DELETE FROM pending_files WHERE cycle = ?", (cycle,))
            conn.executemany(f"INSERT INTO pending_files (cycle, {_FILE_COLUMNS}, change)"
                             " VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def commit(self, cycle: str, note: str | None = None) -> int:
        """Mark `cycle`'s pending files consumed, in one transaction; returns how many files the
        cycle consumed. Committing a committed cycle again changes nothing (task retries)."""
        with self._transaction() as conn:
            status = self._status(conn, cycle)
            if status == "pending":
                conn.execute(f"INSERT INTO consumed ({_FILE_COLUMNS}, cycle, consumed_at)"
                             f" SELECT {_FILE_COLUMNS}, cycle, ? FROM pending_files WHERE cycle = ? ORDER BY uri",
                             (_now(), cycle))
                conn.execute("DELETE FROM pending_files WHERE cycle = ?", (cycle,))
                conn.execute("UPDATE cycles SET status = 'committed', note = ?, ended_at = ? WHERE cycle = ?",
                             (note, _now(), cycle))
            elif status != "committed":
                raise LedgerError(f"cycle {cycle!r} cannot be committed: it is {status or 'unknown to the ledger'}")
            return conn.execute("SELECT COUNT(*) FROM consumed WHERE cycle = ?", (cycle,)).fetchone()[0]

    def reject(self, cycle: str, reason: str) -> None:
        """Close `cycle` without consuming anything: its files stay new for the next discovery;
        the reason and the files it had taken are kept. Rejecting it again keeps the first reason."""
        with self._transaction() as conn:
            status = self._status(conn, cycle)
            if status == "committed":
                raise LedgerError(f"cycle {cycle!r} is committed: its files are consumed and cannot be rejected")
            if status is None:
                conn.execute("INSERT INTO cycles (cycle, status, note, started_at, ended_at)"
                             " VALUES (?, 'rejected', ?, ?, ?)", (cycle, reason, _now(), _now()))
            elif status == "pending":
                conn.execute("UPDATE cycles SET status = 'rejected', note = ?, ended_at = ? WHERE cycle = ?",
                             (reason, _now(), cycle))

    # -- queries -------------------------------------------------------------------------------

    def cycle(self, cycle: str) -> CycleRecord | None:
        with self._read() as conn:
            row = conn.execute("SELECT * FROM cycles WHERE cycle = ?", (cycle,)).fetchone()
        return CycleRecord(**dict(row)) if row else None

    def cycles(self) -> list[CycleRecord]:
        """Every cycle the ledger heard of, oldest first."""
        with self._read() as conn:
            rows = conn.execute("SELECT * FROM cycles ORDER BY started_at, cycle").fetchall()
        return [CycleRecord(**dict(r)) for r in rows]

    def pending_files(self, cycle: str) -> list[RawFile]:
        """The files `cycle` took and has not committed (a rejected cycle's, too)."""
        with self._read() as conn:
            rows = conn.execute(f"SELECT {_FILE_COLUMNS}, change FROM pending_files WHERE cycle = ? ORDER BY uri",
                                (cycle,)).fetchall()
        return [RawFile(**dict(r)) for r in rows]

    def consumed(self, cycle: str | None = None) -> list[ConsumedFile]:
        """Every file version consumed (by `cycle` only, when given), in the order consumed:
        the raw inputs, with their licences, that lineage walks back to."""
        where, args = ("WHERE cycle = ?", (cycle,)) if cycle is not None else ("", ())
        with self._read() as conn:
            rows = conn.execute(f"SELECT {_FILE_COLUMNS}, cycle, consumed_at FROM consumed {where} ORDER BY id",
                                args).fetchall()
        return [ConsumedFile(**dict(r)) for r in rows]
