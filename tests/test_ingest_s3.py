"""s3:// sources against a real S3-compatible server: moto's server on 127.0.0.1, with IAM
authentication switched on, holding real files from shared/data/web. The ingest stage run on
s3:// URIs (globs included, through Ray workers) must give exactly what it gives on the same
files read locally; resume keys use the objects' ETags; a missing object, bad credentials or an
unset credential variable fail with a clear error; reads are ranged (streaming), and no secret
ever reaches the config or the run summary."""
from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import os
import sys
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pydantic import ValidationError

from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, IngestConfig, PipelineConfig, RayConfig, SourceConfig
from tasks.core.documents import iter_docs
from tasks.ingest import run_ingest
from tasks.core.fs import S3ExtraMissing, expand_uri, file_identity, open_source
from tasks.ingest.readers import iter_records
from tasks.ingest.run import resolve_source_files

DATA = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
WEB = DATA / "web"

BUCKET = "crawl"
KEY_VAR, SECRET_VAR = "CRUCIBLE_TEST_S3_KEY", "CRUCIBLE_TEST_S3_SECRET"
UPLOADS = {  # object key -> file under shared/data/web
    "web/wget-sample-0001.warc.gz": "wget-sample-0001.warc.gz",
    "web/whirlwind.warc.gz": "whirlwind.warc.gz",
    "web/whirlwind.warc.wet.gz": "whirlwind.warc.wet.gz",  # not matched by the *.warc.gz glob
    "web/docs-crawl-00000.warc.gz": "docs-crawl-00000.warc.gz",
    "cc/cc-net-head-sample.jsonl.gz": "cc-net-head-sample.jsonl.gz",
}


def _parquet_bytes(n_rows: int) -> bytes:
    """A Parquet file of the first `n_rows` documents of the CCNet sample (id, text, url)."""
    import gzip

    with gzip.open(WEB / "cc-net-head-sample.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in itertools.islice(f, n_rows)]
    table = pa.table({"id": [f"pq-{i}" for i in range(n_rows)], "text": [r["text"] for r in rows],
                      "url": [r["id"] for r in rows]})
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=4)
    return buf.getvalue()


def _post(url: str, body: bytes) -> None:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(req, timeout=10).read()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 with the bucket filled, then IAM authentication switched on:
    from then on only the access key of the IAM user "reader" (in KEY_VAR / SECRET_VAR) works."""
    if not (WEB / "docs-crawl-00000.warc.gz").exists():
        pytest.skip(f"no data under {DATA}")
    pytest.importorskip("s3fs", reason="the s3 extra (s3fs) is not installed")
    pytest.importorskip("moto.server", reason="moto[server] (test extra) is not installed")
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    mp = pytest.MonkeyPatch()
    # no credential from this machine's files and no instance-metadata lookups (never leave loopback)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        mp.delenv(var, raising=False)
    empty = tmp_path_factory.mktemp("aws")
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty / "credentials"))
    mp.setenv("AWS_CONFIG_FILE", str(empty / "config"))
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    mp.setenv("AWS_DEFAULT_REGION", "us-east-1")

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    # moto keeps its backends per process: clear what an earlier module's server left (user "reader")
    _post(f"{endpoint}/moto-api/reset", b"")
    boot = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="setup",
                aws_secret_access_key="setup")
    try:
        iam = boto3.client("iam", **boot)
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="read-crawl", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        access = iam.create_access_key(UserName="reader")["AccessKey"]
        client = boto3.client("s3", **boot)
        client.create_bucket(Bucket=BUCKET)
        for key, name in UPLOADS.items():
            client.upload_file(str(WEB / name), BUCKET, key)
        parquet = _parquet_bytes(9)
        client.put_object(Bucket=BUCKET, Key="pq/docs.parquet", Body=parquet)
        local = tmp_path_factory.mktemp("local")
        (local / "docs.parquet").write_bytes(parquet)
        _post(f"{endpoint}/moto-api/reset-auth", b"0")  # authentication on: every request signed by a known key
        mp.setenv(KEY_VAR, access["AccessKeyId"])
        mp.setenv(SECRET_VAR, access["SecretAccessKey"])
        yield {"endpoint": endpoint, "key": access["AccessKeyId"], "secret": access["SecretAccessKey"],
               "local": local, "boto": boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                                    aws_access_key_id=access["AccessKeyId"],
                                                    aws_secret_access_key=access["SecretAccessKey"])}
    finally:
        try:
            _post(f"{endpoint}/moto-api/reset-auth", b"inf")
        finally:
            server.stop()
            mp.undo()


@pytest.fixture(scope="module")
def ray_session(s3):
    """Ray started after the credential variables are set, so its workers inherit them."""
    import ray

    from tasks.core.ray_utils import init_ray

    if ray.is_initialized():  # left by an earlier module: its workers would lack the variables
        ray.shutdown()
    init_ray(RayConfig(num_cpus=2))
    yield
    ray.shutdown()


def options(s3, **extra) -> dict:
    return {"endpoint_url": s3["endpoint"], "key": "${%s}" % KEY_VAR, "secret": "${%s}" % SECRET_VAR, **extra}


def src(name: str, uri: str, fmt: str, **kw) -> SourceConfig:
    return SourceConfig(name=name, uri=str(uri), format=fmt, licence="test-licence", provenance="test", **kw)


def _strip(docs: list[dict]) -> list[dict]:
    return [{k: v for k, v in d.items() if k != "source_file"} for d in docs]


def _counts(summary: dict) -> dict:
    keys = ("docs_in", "docs_out", "bytes_in", "bytes_out", "dropped", "quarantined", "skipped_records")
    return {k: summary[k] for k in keys} | {
        name: {k: v for k, v in s.items() if k != "files"} for name, s in summary["sources"].items()}


def test_ingest_from_s3_equals_local(s3, ray_session, tmp_path):
    opts = options(s3, default_block_size=1 << 20)
    remote = PipelineConfig(name="s3", ray=RayConfig(num_cpus=2), ingest=IngestConfig(shard_docs=10), sources=[
        src("web", f"s3://{BUCKET}/web/w*.warc.gz", "warc", storage_options=opts),
        src("cc", f"s3://{BUCKET}/cc/*.jsonl.gz", "jsonl", storage_options=opts),
        src("pq", f"s3://{BUCKET}/pq/docs.parquet", "parquet", storage_options=opts)])
    local = PipelineConfig(name="local", ray=RayConfig(num_cpus=2), ingest=IngestConfig(shard_docs=10), sources=[
        src("web", WEB / "w*.warc.gz", "warc"), src("cc", WEB / "cc-net-head-sample.jsonl.gz", "jsonl"),
        src("pq", s3["local"] / "docs.parquet", "parquet")])

    got = run_ingest(remote, tmp_path / "s3")
    want = run_ingest(local, tmp_path / "local")
    assert got["sources"]["web"]["files"] == [f"s3://{BUCKET}/web/wget-sample-0001.warc.gz",
                                              f"s3://{BUCKET}/web/whirlwind.warc.gz"]
    assert got["sources"]["pq"]["files"] == [f"s3://{BUCKET}/pq/docs.parquet"]
    assert _counts(got) == _counts(want)
    assert got["docs_out"] > 20 and got["sources"]["pq"]["docs_out"] == 9 and not got["quarantined"]
    docs, local_docs = list(iter_docs(got["shards"])), list(iter_docs(want["shards"]))
    assert _strip(docs) == _strip(local_docs)
    assert {d["source_file"] for d in docs if d["source"] == "cc"} == {f"s3://{BUCKET}/cc/cc-net-head-sample.jsonl.gz"}

    # no secret in the config as it is dumped (MLflow params, config.json, lineage) or in the summary
    for text in (remote.model_dump_json(), json.dumps(remote.model_dump(mode="json")), json.dumps(got)):
        assert s3["secret"] not in text and s3["key"] not in text
    assert "${%s}" % SECRET_VAR in remote.model_dump_json()

    # resume: unchanged objects (same ETags) -> the verified output is reused as it stands
    again = run_ingest(remote, tmp_path / "s3")
    assert again.get("resumed_complete") is True and _counts(again) == _counts(got)
    # an object rewritten with other content has a new identity: the stored output no longer counts
    before = file_identity(f"s3://{BUCKET}/pq/docs.parquet", opts)
    s3["boto"].put_object(Bucket=BUCKET, Key="pq/docs.parquet", Body=_parquet_bytes(11))
    after = file_identity(f"s3://{BUCKET}/pq/docs.parquet", opts)
    assert before[0] == after[0] and before[2] != after[2] and before[1] != after[1]
    third = run_ingest(remote, tmp_path / "s3")
    assert not third.get("resumed_complete")
    assert third["sources"]["pq"]["docs_out"] == 11 and third["docs_out"] == got["docs_out"] + 2
    s3["boto"].put_object(Bucket=BUCKET, Key="pq/docs.parquet", Body=(s3["local"] / "docs.parquet").read_bytes())


def test_file_identity_is_the_objects_size_and_etag(s3):
    uri = f"s3://{BUCKET}/web/whirlwind.warc.gz"
    ident = file_identity(uri, options(s3))
    head = s3["boto"].head_object(Bucket=BUCKET, Key="web/whirlwind.warc.gz")
    assert ident == [uri, (WEB / "whirlwind.warc.gz").stat().st_size, head["ETag"]]
    assert head["ETag"].strip('"') == hashlib.md5((WEB / "whirlwind.warc.gz").read_bytes()).hexdigest()


def test_open_source_streams_with_ranged_reads(s3):
    """A 6 MB WARC read with 1 MiB blocks: the first record arrives after about one block has been
    fetched, the stream is seekable, and the whole read gives the file's exact bytes."""
    uri = f"s3://{BUCKET}/web/docs-crawl-00000.warc.gz"
    path = WEB / "docs-crawl-00000.warc.gz"
    size = path.stat().st_size
    opts = options(s3, default_block_size=1 << 20)
    with open_source(uri, opts) as fh:
        assert fh.seekable()
        head = fh.read(64 * 1024)
        fetched = fh.raw._f.cache.total_requested_bytes
        assert 64 * 1024 <= fetched <= 3 << 20 < size
        rest = fh.read()
        assert hashlib.sha256(head + rest).digest() == hashlib.sha256(path.read_bytes()).digest()
        assert fh.raw._f.cache.total_requested_bytes <= size + (3 << 20)
    # the reader on the stream: the first records equal the local file's, without reading it all
    def first(records) -> list[tuple]:
        return [(type(r).__name__, r.offset, getattr(r, "key", None), getattr(r, "payload", None))
                for r in itertools.islice(records, 6)]

    assert first(iter_records(uri, "warc", storage_options=opts)) == first(iter_records(path, "warc"))


def test_missing_objects_and_bad_credentials_are_clear_errors(s3, monkeypatch):
    opts = options(s3)
    cfg = PipelineConfig(name="t", sources=[src("a", f"s3://{BUCKET}/web/*.warc.gz", "warc", storage_options=opts)])
    assert len(resolve_source_files(cfg, cfg.sources[0])) == 3
    for uri in (f"s3://{BUCKET}/web/no-such.warc.gz", f"s3://{BUCKET}/nothing/*.warc.gz"):
        with pytest.raises(FileNotFoundError, match="no files match"):
            resolve_source_files(cfg, src("b", uri, "warc", storage_options=opts))
    with pytest.raises(FileNotFoundError):
        open_source(f"s3://{BUCKET}/web/no-such.warc.gz", opts)

    # a wrong secret: PermissionError naming the URI, never the credential; nothing is written
    monkeypatch.setenv(SECRET_VAR, "not-the-secret")
    for call in (lambda: expand_uri(f"s3://{BUCKET}/web/*.warc.gz", opts),
                 lambda: expand_uri(f"s3://{BUCKET}/web/whirlwind.warc.gz", opts),
                 lambda: file_identity(f"s3://{BUCKET}/web/whirlwind.warc.gz", opts),
                 lambda: open_source(f"s3://{BUCKET}/web/whirlwind.warc.gz", opts).read(1)):
        with pytest.raises(PermissionError, match=rf"access to s3://{BUCKET}/web/\S+ denied") as e:
            call()
        assert "not-the-secret" not in str(e.value) and s3["key"] not in str(e.value)
    # an access key the server does not know
    monkeypatch.setenv(KEY_VAR, "AKIAUNKNOWN000000000")
    with pytest.raises(PermissionError, match="check the source's credentials"):
        run_ingest(cfg, s3["local"] / "denied")
    assert not list((s3["local"] / "denied").iterdir())  # planning failed: nothing written

    # a credential variable that is not set
    monkeypatch.delenv(SECRET_VAR)
    with pytest.raises(ValueError, match=f"environment variable {SECRET_VAR}, which is not set"):
        expand_uri(f"s3://{BUCKET}/web/*.warc.gz", opts)


def test_literal_credentials_are_refused_in_the_config():
    for bad, path in (({"key": "AKIA123", "secret": "${X}"}, "key"),
                      ({"secret": "plain"}, "secret"),
                      ({"token": "t"}, "token"),
                      ({"client_kwargs": {"aws_secret_access_key": "s"}}, "client_kwargs.aws_secret_access_key"),
                      ({"s3_additional_kwargs": {"SSECustomerKey": "k"}}, "s3_additional_kwargs.SSECustomerKey"),
                      ({"password": "p"}, "password")):
        with pytest.raises(ValidationError, match=rf"storage_options {path}: credentials must come from the env"):
            src("a", f"s3://{BUCKET}/x", "warc", storage_options=bad)
    ok = src("a", f"s3://{BUCKET}/x", "warc", storage_options={
        "endpoint_url": "http://127.0.0.1:9000", "anon": False, "key": "${K}",
        "client_kwargs": {"region_name": "eu-west-1"}, "config_kwargs": {"max_pool_connections": 4}})
    assert ok.storage_options["key"] == "${K}"


def test_standard_aws_environment_is_honoured(s3, monkeypatch):
    """No storage_options: the endpoint and credentials come from AWS_ENDPOINT_URL_S3 /
    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY through botocore, as for any AWS tool."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3["endpoint"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3["secret"])
    try:
        assert expand_uri(f"s3://{BUCKET}/web/w*.warc.gz") == [f"s3://{BUCKET}/web/wget-sample-0001.warc.gz",
                                                             f"s3://{BUCKET}/web/whirlwind.warc.gz"]
        with open_source(f"s3://{BUCKET}/web/whirlwind.warc.gz") as fh:
            assert fh.read() == (WEB / "whirlwind.warc.gz").read_bytes()
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_s3_without_the_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if the s3 extra were not installed
    with pytest.raises(S3ExtraMissing, match=r"crucible\[s3\]"):
        expand_uri("s3://some-bucket/crawl/*.warc.gz")


def test_config_file_with_a_literal_credential_fails_without_echoing_it(tmp_path):
    from tasks.config import ConfigError, load_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: t\nsources:\n  - {name: a, uri: 's3://b/*.warc.gz', format: warc, licence: l, provenance: p,\n"
                   "     storage_options: {endpoint_url: 'http://127.0.0.1:9000', secret: hunter2}}\n")
    with pytest.raises(ConfigError, match=r"sources\.0\.storage_options: .*storage_options secret") as e:
        load_config(cfg)
    assert "hunter2" not in str(e.value)
    cfg.write_text(cfg.read_text().replace("secret: hunter2", "secret: '${MY_SECRET}'"))
    assert load_config(cfg).sources[0].storage_options["secret"] == "${MY_SECRET}"


def test_duplicate_id_tasks_read_and_write_a_store_prefix(s3, tmp_path):
    """The duplicate-id tasks as they run where the cluster's nodes do not share the driver's disk:
    the jobs' id files and parts read on the store, the drops written there, and a shard packed
    from two jobs' parts (one without its duplicate) uploaded to the stage's prefix."""
    import io

    from tasks.core.documents import iter_docs, make_doc_id, write_docs
    from tasks.core.fs import read_bytes, upload
    from tasks.ingest import ids

    opts = options(s3)
    stage = f"s3://{BUCKET}/run/ingest"
    for name, keys in {"j1": ["a", "b"], "j2": ["b", "c"]}.items():
        docs = [{"id": make_doc_id("s", k), "text": f"text {k}"} for k in keys]
        part = write_docs(docs, tmp_path, shard_docs=3, prefix=name)[0]
        upload(part, f"{stage}/_parts/{part.name}", opts)
        spill = ids.IdSpill(tmp_path / f"{name}-ids", 1)
        for d in docs:
            spill.add(d["id"], 6)
        upload(spill.close()[0], f"{stage}/_parts/{name}-ids/p-00000/s-000000.parquet", opts)
    got = ids.resolve_partition([(n, [f"{stage}/_parts/{n}-ids/p-00000/s-000000.parquet"]) for n in ("j1", "j2")],
                                0, 3, f"{stage}/_parts/_id_drops", opts)
    assert got == {"j2": [[0, 1, 6]]}  # j2's row 0 (b) is j1's row 1
    shard = ids.write_shard([(f"{stage}/_parts/j1-00000.parquet", 0, []),
                             (f"{stage}/_parts/j2-00000.parquet", 0, [f"{stage}/_parts/_id_drops/j2/p-00000.parquet"])],
                            4, 3, stage, opts, opts)
    assert shard == f"{stage}/shard-00004.parquet"
    assert [d["id"] for d in iter_docs([io.BytesIO(read_bytes(shard, opts))])] == \
        [make_doc_id("s", k) for k in ("a", "b", "c")]


def test_stale_shards_of_a_longer_run_are_removed_from_a_store_run_root(s3, ray_session, tmp_path, monkeypatch):
    """run_root on a store whose prefix other nodes write to (the shard tasks upload there): a
    killed earlier run with more shards left `shard-00042.parquet` on the store, which this run's
    manifest would not list and no push removes; ingest deletes it once its own shards are written,
    and keeps the store's other objects and the shards the tasks wrote."""
    import tasks.core.ray_utils as ray_utils
    from tasks.core import storage

    s3["boto"].create_bucket(Bucket="runs")
    monkeypatch.setattr(storage, "_STORES", {})
    store = storage.open_store("s3://runs/crucible", options(s3), str(tmp_path / "cache"), check_timeout=20)
    prefix = "crucible/r1/ingest/"
    for key in ("shard-00042.parquet", "shard-00000.parquet", "notes.txt"):
        s3["boto"].put_object(Bucket="runs", Key=prefix + key, Body=b"an earlier run's")
    monkeypatch.setattr(ray_utils, "only_this_node", lambda: False)  # tasks write the store's prefix
    folder = tmp_path / "src"
    folder.mkdir()
    for f, keys in enumerate((["a", "b", "c"], ["b", "d"])):  # b again: f1's part is rewritten by a task
        (folder / f"f{f}.jsonl").write_text("".join(json.dumps({"id": k, "text": f"text {k}"}) + "\n" for k in keys))
    cfg = PipelineConfig(name="stale", sources=[src("s", folder / "*.jsonl", "jsonl")],
                         ray=RayConfig(num_cpus=2), ingest=IngestConfig(shard_docs=2))
    s = run_ingest(cfg, store.local_root / "r1" / "ingest")
    assert s["shards_written"] >= 1 and s["docs_out"] == 4
    left = {o["Key"][len(prefix):] for o in s3["boto"].list_objects_v2(Bucket="runs", Prefix=prefix)["Contents"]}
    assert "shard-00042.parquet" not in left and "notes.txt" in left, sorted(left)
    shards = sorted(Path(p).name for p in s["shards"])
    assert {n for n in left if n.startswith("shard-")} <= set(shards), sorted(left)
