"""The data ledger of continued pretraining (tasks.continued.ledger) on real files from
shared/data/web copied into a landing folder: discovery of unseen and changed files, commit only
when a cycle ends (one transaction), rejection, a SIGKILLed cycle leaving the ledger as it was,
several processes on one ledger, s3:// sources through a real moto server, and the `continue`
config section."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tasks.config import (DATA_ROOT_ENV, DEFAULT_DATA_ROOT, ConfigError, PipelineConfig, SourceConfig,
                          load_config)
from tasks.continued import ledger as ledger_mod
from tasks.continued.ledger import Ledger, LedgerError, RawFile, ledger_path
from tasks.core.constants import REPO_ROOT

# the moto S3 server (IAM on, reader credentials in the environment) of the s3 ingest tests
from test_ingest_s3 import BUCKET, options, s3  # noqa: F401

WEB = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT) / "web"
FIRST_FILES = {"whirlwind.warc.gz": "web", "wget-sample-0001.warc.gz": "web", "cc-net-head-sample.jsonl.gz": "cc"}


@pytest.fixture
def landing(tmp_path) -> Path:
    """A landing folder holding the first delivery: two WARCs and a JSONL file."""
    if not (WEB / "docs-crawl-00000.warc.gz").exists():
        pytest.skip(f"no data under {WEB}")
    folder = tmp_path / "landing"
    folder.mkdir()
    for name in FIRST_FILES:
        shutil.copyfile(WEB / name, folder / name)
    return folder


def config(landing: Path, ledger: str = "ledger.db") -> PipelineConfig:
    return PipelineConfig.model_validate({
        "name": "cont", "continue": {"ledger": ledger}, "sources": [
            {"name": "web", "uri": str(landing / "*.warc.gz"), "format": "warc", "licence": "CC-BY-4.0",
             "provenance": "docs crawl"},
            {"name": "cc", "uri": str(landing / "*.jsonl.gz"), "format": "jsonl", "licence": "CC-BY-SA-4.0",
             "provenance": "ccnet"}]})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def new_uris(discovery) -> dict[str, str]:
    return {Path(f.uri).name: f.change for f in discovery.files}


def run_cycle(ledger: Ledger, cfg: PipelineConfig, cycle: str) -> int:
    ledger.pending(cycle, ledger.discover(cfg).files)
    return ledger.commit(cycle)


def later_mtime(path: Path) -> None:
    """A later modification time, as a rewrite seconds after the first write would have."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


def test_first_discovery_finds_every_file_with_its_identity(landing, tmp_path):
    cfg = config(landing)
    ledger = Ledger.for_config(cfg, tmp_path / "state")
    assert ledger.path == tmp_path / "state" / "ledger.db"
    found = ledger.discover(cfg)
    assert new_uris(found) == dict.fromkeys(FIRST_FILES, "unseen")
    assert found.unchanged == 0 and not found.empty
    assert {s.source: s.listed for s in found.sources} == {"web": 2, "cc": 1}
    for f in found.files:
        local = landing / Path(f.uri).name
        assert f.uri == str(local.resolve())
        assert (f.source, f.size, f.sha256) == (FIRST_FILES[local.name], local.stat().st_size, sha256(local))
        assert f.stamp == str(local.stat().st_mtime_ns)
        assert f.licence == {"web": "CC-BY-4.0", "cc": "CC-BY-SA-4.0"}[f.source]
    assert found.message.startswith("3 new file(s) (3 unseen, 0 changed: web 2, cc 1)")
    assert json.loads(json.dumps(found.to_dict()))["sources"]["web"]["listed"] == 2


def test_after_commit_nothing_is_new_and_the_record_holds_each_file(landing, tmp_path):
    cfg = config(landing)
    ledger = Ledger(tmp_path / "ledger.db")
    first = ledger.discover(cfg)
    ledger.pending("cycle-1", first.files)
    assert ledger.consumed() == [] and ledger.cycle("cycle-1").status == "pending"
    assert ledger.commit("cycle-1", note="registered version 1") == 3
    assert ledger.commit("cycle-1") == 3  # a retried commit task changes nothing

    again = ledger.discover(cfg)
    assert again.empty and again.files == [] and again.unchanged == 3
    assert again.message.startswith("no new data")
    record = {Path(c.uri).name: c for c in ledger.consumed()}
    assert set(record) == set(FIRST_FILES)
    for f in first.files:
        c = record[Path(f.uri).name]
        assert (c.uri, c.source, c.size, c.stamp, c.sha256, c.licence, c.cycle) == \
               (f.uri, f.source, f.size, f.stamp, f.sha256, f.licence, "cycle-1")
        assert c.consumed_at
    cycle = ledger.cycle("cycle-1")
    assert (cycle.status, cycle.note) == ("committed", "registered version 1") and cycle.ended_at
    assert ledger.pending_files("cycle-1") == []
    assert Ledger(tmp_path / "ledger.db").discover(cfg).empty  # persistent: a new process sees the same


def test_only_a_newly_landed_file_is_new(landing, tmp_path):
    cfg = config(landing)
    ledger = Ledger(tmp_path / "ledger.db")
    run_cycle(ledger, cfg, "cycle-1")
    shutil.copyfile(WEB / "docs-crawl-00000.warc.gz", landing / "docs-crawl-00000.warc.gz")
    found = ledger.discover(cfg)
    assert new_uris(found) == {"docs-crawl-00000.warc.gz": "unseen"}
    assert found.unchanged == 3 and found.files[0].source == "web"
    assert run_cycle(ledger, cfg, "cycle-2") == 1
    assert ledger.discover(cfg).empty
    assert [Path(c.uri).name for c in ledger.consumed("cycle-2")] == ["docs-crawl-00000.warc.gz"]


def test_rewritten_content_is_new_and_a_touched_file_is_not(landing, tmp_path, monkeypatch):
    cfg = config(landing)
    ledger = Ledger(tmp_path / "ledger.db")
    run_cycle(ledger, cfg, "cycle-1")
    hashed = []
    real_sha256 = ledger_mod.sha256_uri
    monkeypatch.setattr(ledger_mod, "sha256_uri", lambda uri, opts=None: hashed.append(Path(uri).name)
                        or real_sha256(uri, opts))

    regrown = landing / "whirlwind.warc.gz"  # re-crawled under the same name: other bytes, other size
    shutil.copyfile(WEB / "docs-crawl-00001.warc.gz", regrown)
    later_mtime(regrown)
    same_size = landing / "cc-net-head-sample.jsonl.gz"  # same size, one byte differs
    data = bytearray(same_size.read_bytes())
    data[-1] ^= 0xFF
    same_size.write_bytes(bytes(data))
    later_mtime(same_size)
    touched = landing / "wget-sample-0001.warc.gz"  # same bytes, later mtime
    later_mtime(touched)

    found = ledger.discover(cfg)
    assert new_uris(found) == {"whirlwind.warc.gz": "changed", "cc-net-head-sample.jsonl.gz": "changed"}
    assert {f.sha256 for f in found.files} == {sha256(regrown), sha256(same_size)}
    assert sorted(hashed) == sorted(FIRST_FILES)  # local files are always hashed: content decides
    assert run_cycle(ledger, cfg, "cycle-2") == 2
    # the record keeps both versions; the latest one is current
    assert [c.cycle for c in ledger.consumed() if c.uri == str(regrown.resolve())] == ["cycle-1", "cycle-2"]
    hashed.clear()
    assert ledger.discover(cfg).empty  # the touched file's bytes are those consumed: not new
    assert sorted(hashed) == sorted(FIRST_FILES)


def test_a_swapped_file_of_equal_size_and_mtime_is_changed(landing, tmp_path):
    """Other bytes under the same name, the same size and the modification time set back: the content
    hash, not size and mtime, says whether a local file was consumed."""
    cfg = config(landing)
    ledger = Ledger(tmp_path / "ledger.db")
    run_cycle(ledger, cfg, "cycle-1")
    swapped = landing / "cc-net-head-sample.jsonl.gz"
    st = swapped.stat()
    data = bytearray(swapped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    swapped.write_bytes(bytes(data))
    os.utime(swapped, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (swapped.stat().st_size, swapped.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    found = ledger.discover(cfg)
    assert new_uris(found) == {"cc-net-head-sample.jsonl.gz": "changed"}
    assert found.files[0].sha256 == sha256(swapped)


def test_a_forged_or_unsigned_ledger_is_refused(landing, tmp_path, caplog):
    """The ledger is signed with the stack's key (purpose "ledger"): a row an outsider writes to hide a
    newly landed file, a deleted cycle, a planted trigger or a ledger nobody signed is refused, never trusted."""
    from tasks.core.signing import SignatureError

    cfg = config(landing)
    path = tmp_path / "ledger.db"
    run_cycle(Ledger(path), cfg, "cycle-1")
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the whole ledger in its main file
    shutil.copyfile(WEB / "docs-crawl-00000.warc.gz", landing / "docs-crawl-00000.warc.gz")
    planted = landing / "docs-crawl-00000.warc.gz"

    def copy(name: str, *statements: str, args=()) -> Path:
        """A copy of the genuine ledger, edited by someone without the key."""
        forged = tmp_path / name
        shutil.copyfile(path, forged)
        with sqlite3.connect(forged) as conn:
            for sql in statements:
                conn.execute(sql, args if "?" in sql else ())
        return forged

    assert new_uris(Ledger(copy("control.db")).discover(cfg)) == {"docs-crawl-00000.warc.gz": "unseen"}
    hide = ("INSERT INTO consumed (uri, source, size, stamp, sha256, licence, cycle, consumed_at)"
            " VALUES (?, 'web', ?, ?, ?, 'CC-BY-4.0', 'cycle-1', '2024-01-01')")
    forgeries = {
        "hidden.db": [(hide,), (str(planted.resolve()), planted.stat().st_size, str(planted.stat().st_mtime_ns),
                                sha256(planted))],  # a consumed row hiding the new file
        "deleted.db": [("DELETE FROM consumed", "DELETE FROM cycles"), ()],  # a cycle erased
        "trigger.db": [("CREATE TRIGGER t AFTER INSERT ON pending_files BEGIN DELETE FROM pending_files; END",), ()],
    }
    for name, (statements, args) in forgeries.items():
        forged = copy(name, *statements, args=args)
        caplog.clear()
        with pytest.raises(SignatureError, match="data ledger .*does not verify"):
            Ledger(forged).discover(cfg)
        assert "refused: data ledger" in caplog.text, name

    unsigned = tmp_path / "unsigned.db"  # the schema and rows as an unsigned writer leaves them
    with sqlite3.connect(unsigned) as conn:
        conn.executescript(ledger_mod._SCHEMA)
    with pytest.raises(SignatureError, match="data ledger .*unsigned"):
        Ledger(unsigned)


_KILLED_CYCLE = """
import os, signal, sys
from pathlib import Path
from tasks.config import PipelineConfig
from tasks.continued.ledger import Ledger
cfg = PipelineConfig.model_validate_json(Path(sys.argv[1]).read_text())
ledger = Ledger(sys.argv[2])
ledger.pending("cycle-2", ledger.discover(cfg).files)
print("pending recorded", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the cycle dies before its model is registered
"""


def test_a_sigkilled_cycle_leaves_the_ledger_unchanged(landing, tmp_path):
    cfg = config(landing)
    ledger = Ledger(tmp_path / "ledger.db")
    run_cycle(ledger, cfg, "cycle-1")
    shutil.copyfile(WEB / "docs-crawl-00000.warc.gz", landing / "docs-crawl-00000.warc.gz")
    before = ledger.consumed()
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(cfg.model_dump_json())
    proc = subprocess.run([sys.executable, "-c", _KILLED_CYCLE, str(cfg_file), str(ledger.path)], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9 and "pending recorded" in proc.stdout, proc.stderr

    assert ledger.consumed() == before
    assert ledger.cycle("cycle-2").status == "pending"
    assert new_uris(ledger.discover(cfg)) == {"docs-crawl-00000.warc.gz": "unseen"}  # the next cycle retries it
    assert run_cycle(ledger, cfg, "cycle-3") == 1
    assert ledger.discover(cfg).empty


def test_commit_is_one_transaction(landing, tmp_path, monkeypatch):
    cfg = config(landing)
    ledger = Ledger(tmp_path / "ledger.db")
    ledger.pending("cycle-1", ledger.discover(cfg).files)

    def fail(conn):  # the commit fails at its last step, after every statement: signing the new content
        raise sqlite3.DatabaseError("injected failure")

    with monkeypatch.context() as m:
        m.setattr(Ledger, "_sign", staticmethod(fail))
        with pytest.raises(sqlite3.DatabaseError, match="injected failure"):
            ledger.commit("cycle-1")
    assert ledger.consumed() == [] and ledger.cycle("cycle-1").status == "pending"
    assert len(ledger.pending_files("cycle-1")) == 3 and len(ledger.discover(cfg).files) == 3
    assert ledger.commit("cycle-1") == 3


def test_reject_records_the_reason_and_the_files_stay_new(landing, tmp_path):
    cfg = config(landing)
    ledger = Ledger(tmp_path / "ledger.db")
    taken = ledger.discover(cfg).files
    ledger.pending("cycle-1", taken)
    ledger.reject("cycle-1", "gate: no improvement on the new data")
    ledger.reject("cycle-1", "a later reason")  # rejecting again keeps the first reason

    cycle = ledger.cycle("cycle-1")
    assert (cycle.status, cycle.note) == ("rejected", "gate: no improvement on the new data") and cycle.ended_at
    assert ledger.consumed() == []
    assert ledger.pending_files("cycle-1") == sorted(taken, key=lambda f: f.uri)  # what it had taken is kept
    assert sorted(ledger.discover(cfg).files, key=lambda f: f.uri) == sorted(taken, key=lambda f: f.uri)
    with pytest.raises(LedgerError, match="cannot be committed: it is rejected"):
        ledger.commit("cycle-1")
    with pytest.raises(LedgerError, match="already rejected"):
        ledger.pending("cycle-1", taken)
    assert run_cycle(ledger, cfg, "cycle-2") == 3
    with pytest.raises(LedgerError, match="is committed"):
        ledger.reject("cycle-2", "too late")
    assert [c.status for c in ledger.cycles()] == ["rejected", "committed"]


_LOCK_HOLDER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(1.5)
conn.execute("COMMIT")
"""


def test_a_writer_waits_for_another_process_transaction(tmp_path):
    ledger = Ledger(tmp_path / "ledger.db")
    with sqlite3.connect(ledger.path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    holder = subprocess.Popen([sys.executable, "-c", _LOCK_HOLDER, str(ledger.path)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"  # another process holds the write lock
        t0 = time.monotonic()
        ledger.pending("cycle-1", [RawFile("s3://b/k", "web", 1, "etag", "0" * 64, "CC0")])
        assert time.monotonic() - t0 >= 0.5  # waited (busy timeout) instead of failing "database is locked"
        assert ledger.commit("cycle-1") == 1
    finally:
        assert holder.wait(timeout=60) == 0


_WRITER = """
import sys
from tasks.continued.ledger import Ledger, RawFile
ledger, who = Ledger(sys.argv[1]), sys.argv[2]
for i in range(20):
    cycle = f"{who}-{i}"
    ledger.pending(cycle, [RawFile(f"s3://b/{cycle}/{j}", "web", j, "etag", "%064x" % j, "CC0") for j in range(5)])
    ledger.commit(cycle)
"""


def test_two_processes_share_one_ledger(tmp_path):
    path = tmp_path / "ledger.db"
    Ledger(path)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), who], cwd=REPO_ROOT, env=env,
                              stderr=subprocess.PIPE, text=True) for who in ("a", "b")]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    ledger = Ledger(path)
    assert len(ledger.consumed()) == 2 * 20 * 5
    assert {c.status for c in ledger.cycles()} == {"committed"} and len(ledger.cycles()) == 40
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_s3_objects_are_identified_by_etag(s3, tmp_path, monkeypatch):  # noqa: F811
    client = s3["boto"]
    for key, name in (("landing/a.warc.gz", "whirlwind.warc.gz"), ("landing/b.warc.gz", "wget-sample-0001.warc.gz")):
        client.upload_file(str(WEB / name), BUCKET, key)
    cfg = PipelineConfig(name="cont", sources=[SourceConfig(
        name="web", uri=f"s3://{BUCKET}/landing/*.warc.gz", format="warc", licence="CC-BY-4.0",
        provenance="docs crawl", storage_options=options(s3))])
    ledger = Ledger(tmp_path / "ledger.db")
    first = ledger.discover(cfg)
    assert {f.uri: f.change for f in first.files} == {f"s3://{BUCKET}/landing/a.warc.gz": "unseen",
                                                      f"s3://{BUCKET}/landing/b.warc.gz": "unseen"}
    etag = client.head_object(Bucket=BUCKET, Key="landing/a.warc.gz")["ETag"]
    a = next(f for f in first.files if f.uri.endswith("a.warc.gz"))
    assert (a.stamp, a.size, a.sha256) == (etag, (WEB / "whirlwind.warc.gz").stat().st_size,
                                           sha256(WEB / "whirlwind.warc.gz"))
    ledger.pending("cycle-1", first.files)
    ledger.commit("cycle-1")
    assert ledger.discover(cfg).empty

    hashed = []
    real_sha256 = ledger_mod.sha256_uri
    monkeypatch.setattr(ledger_mod, "sha256_uri", lambda uri, opts=None: hashed.append(uri)
                        or real_sha256(uri, opts))
    client.upload_file(str(WEB / "whirlwind.warc.gz"), BUCKET, "landing/a.warc.gz")  # same bytes: same ETag
    client.upload_file(str(WEB / "docs-crawl-00002.warc.gz"), BUCKET, "landing/b.warc.gz")  # new content
    found = ledger.discover(cfg)
    assert {f.uri: f.change for f in found.files} == {f"s3://{BUCKET}/landing/b.warc.gz": "changed"}
    assert found.files[0].sha256 == sha256(WEB / "docs-crawl-00002.warc.gz")
    assert hashed == [f"s3://{BUCKET}/landing/b.warc.gz"]  # the unchanged ETag spared a download


def test_continue_section_in_yaml_dumps_and_round_trips(tmp_path):
    raw = yaml.safe_load((REPO_ROOT / "configs" / "tiny.yaml").read_text())
    raw["continue"] = {"ledger": "cycles/ledger.db"}
    path = tmp_path / "continue.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path)
    assert cfg.continue_.ledger == "cycles/ledger.db"
    assert ledger_path(cfg, tmp_path / "state") == tmp_path / "state" / "cycles" / "ledger.db"
    assert ledger_path(load_config(path, [f"continue.ledger={tmp_path}/abs.db"]), "/elsewhere") == \
           tmp_path / "abs.db"
    assert cfg.model_dump(mode="json", by_alias=True)["continue"]["ledger"] == "cycles/ledger.db"
    for dumped in (cfg.model_dump(mode="json"), cfg.model_dump(mode="json", by_alias=True)):
        assert PipelineConfig.model_validate(dumped) == cfg
    assert PipelineConfig.model_validate_json(cfg.model_dump_json()) == cfg
    with pytest.raises(ConfigError, match=r"continue\.ledgr"):
        load_config(path, ["continue.ledgr=x.db"])
    with pytest.raises(ConfigError, match=r"continue\.schedule.*not a cron expression"):
        load_config(path, ["continue.schedule=every night"])
    with pytest.raises(ConfigError, match=r"continue\.timezone.*IANA"):
        load_config(path, ["continue.timezone=Mars/Olympus"])
    with pytest.raises(ConfigError, match=r"continue\.replay_fraction"):
        load_config(path, ["continue.replay_fraction=1.0"])
    assert load_config(path, ["continue.schedule=0 3 * * *"]).continue_.schedule == "0 3 * * *"
    for existing in sorted((REPO_ROOT / "configs").glob("*.yaml")):
        assert load_config(existing).continue_.ledger == "ledger.db"
