"""Fuzzing every HTTP surface and property tests of the readers (issue 16).

- schemathesis generates requests from the model server's and the lineage service's OpenAPI
  schemas (seeded: derandomized, a few hundred cases per service). Required: no 5xx, every
  response matches its documented status codes, content types and schema, and the server still
  answers afterwards.
- hypothesis writes arbitrary bytes as JSONL, WARC and Parquet sources and arbitrary Unicode as
  documents: every record the readers produce is kept, dropped with a reason or quarantined with a
  reason, and the counts add up."""
from __future__ import annotations

import io
import json
from pathlib import Path

import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_headers_conformance,
                                 response_schema_conformance, status_code_conformance)

from lm_helpers import random_checkpoint, sample_tokenizer

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
FUZZ = settings(max_examples=40, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
TOKEN = "fuzz-token"


def _model_server_app(root: Path):
    from infra.services.model_server.server import create_app
    from tasks.deploy.generation import TextGenerator

    root.mkdir(parents=True, exist_ok=True)
    tok = sample_tokenizer(root / "tokenizer.json")
    gen = TextGenerator.from_files(random_checkpoint(root / "train", tok, 10, 0), tok)
    return create_app(gen, "m", max_tokens_limit=16, max_n=2, admin_key="adm1n", max_body_bytes=20_000)


def _lineage_app(root: Path):
    from infra.services.lineage import create_app
    from infra.services.lineage.sample import write_sample_log
    from tasks.lineage.replay import replay

    root.mkdir(parents=True, exist_ok=True)
    app = create_app(root / "lineage.db", write_token=TOKEN)
    log, _ = write_sample_log(root / "runs", pipelines=1)
    with TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        replay(log, "http://testserver", client=c)
    return app


# the schema is read from the app itself (no lifespan); the calls go through one open client
_ROOT = Path(__import__("tempfile").mkdtemp(prefix="crucible-fuzz-"))
MODEL_APP, LINEAGE_APP = _model_server_app(_ROOT / "model"), _lineage_app(_ROOT / "lineage")
MODEL_SCHEMA = schemathesis.openapi.from_dict(MODEL_APP.openapi())
LINEAGE_SCHEMA = schemathesis.openapi.from_dict(LINEAGE_APP.openapi())
CLIENTS: dict[str, TestClient] = {}


def _client(name: str, app) -> TestClient:
    if name not in CLIENTS:
        CLIENTS[name] = TestClient(app, headers={"Authorization": f"Bearer {TOKEN}"} if name == "lineage" else {})
        CLIENTS[name].__enter__()
    return CLIENTS[name]


def _call(client: TestClient, case) -> None:
    kw = case.as_transport_kwargs(base_url="http://testserver")
    response = client.request(**{k: v for k, v in kw.items()
                                 if k in ("method", "url", "headers", "params", "json", "content", "cookies")})
    case.validate_response(response, checks=CHECKS)


@MODEL_SCHEMA.parametrize()
@FUZZ
def test_model_server_survives_its_fuzzer(case):
    _call(_client("model", MODEL_APP), case)


@LINEAGE_SCHEMA.parametrize()
@FUZZ
def test_lineage_service_survives_its_fuzzer(case):
    _call(_client("lineage", LINEAGE_APP), case)


def test_both_servers_still_answer_after_the_fuzzers():
    model = _client("model", MODEL_APP)
    assert model.post("/v1/completions", json={"prompt": "The", "max_tokens": 2}).status_code == 200
    assert model.get("/health").json()["status"] == "ok"
    lineage = _client("lineage", LINEAGE_APP)
    assert lineage.get("/healthz").status_code == 200
    assert lineage.get("/api/v1/crucible/stats").json()["events"] > 0


# --------------------------------------------------------------------- the readers, on any bytes

def _accounted(path: Path, fmt: str) -> dict:
    """Every candidate record of the file through ingest's record step: the counts must add up."""
    from tasks.config import IngestConfig, SourceConfig
    from tasks.ingest.process import process_file_range

    source = SourceConfig(name="fuzz", uri=str(path), format=fmt, licence="test", provenance="hypothesis")
    res = process_file_range(source, str(path), IngestConfig(max_record_bytes=50_000))
    assert res["docs_in"] == res["docs_out"] + sum(res["dropped"].values()) + sum(res["quarantined"].values())
    assert all(reason for reason in list(res["dropped"]) + list(res["quarantined"]))
    assert len(res["quarantine"]) == sum(res["quarantined"].values())
    assert all(e["reason"] and "offset" in e for e in res["quarantine"])
    return res


@settings(max_examples=60, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=4000), fmt=st.sampled_from(["jsonl", "warc", "wet", "text"]))
def test_readers_account_for_every_record_of_arbitrary_bytes(tmp_path_factory, data, fmt):
    path = tmp_path_factory.mktemp("bytes") / f"f.{fmt}"
    path.write_bytes(data)
    _accounted(path, fmt)


@settings(max_examples=40, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(texts=st.lists(st.one_of(st.text(max_size=300), st.integers(), st.none(), st.binary(max_size=50)),
                      max_size=12), gz=st.booleans())
def test_jsonl_and_parquet_of_arbitrary_unicode_and_values(tmp_path_factory, texts, gz):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    base = tmp_path_factory.mktemp("unicode")
    lines = [json.dumps({"id": str(i), "text": t if not isinstance(t, bytes) else t.decode("latin-1")})
             for i, t in enumerate(texts)]
    body = "\n".join(lines).encode("utf-8", "surrogatepass")
    (base / "docs.jsonl.gz" if gz else base / "docs.jsonl").write_bytes(gzip.compress(body) if gz else body)
    res = _accounted(base / ("docs.jsonl.gz" if gz else "docs.jsonl"), "jsonl")
    assert res["docs_in"] == len([t for t in lines if t.strip()]) or not lines
    table = pa.table({"id": [str(i) for i in range(len(texts))],
                      "text": [t if isinstance(t, str) else None for t in texts]})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    (base / "docs.parquet").write_bytes(buf.getvalue())
    _accounted(base / "docs.parquet", "parquet")


@settings(max_examples=25, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(lines=st.lists(st.one_of(
    st.builds(lambda t, i: json.dumps({"id": f"d{i}", "text": t}, ensure_ascii=False).encode("utf-8", "surrogatepass"),
              st.text(max_size=400), st.integers(0, 5)),
    st.binary(max_size=80)), max_size=15))
def test_filter_and_dedup_clis_answer_every_line_of_arbitrary_input(tmp_path_factory, lines):
    """`crucible filter` and `crucible dedup` on any bytes and Unicode: one answer per non-blank
    line, kept or dropped with a reason, and the counts add up."""
    import argparse

    from infra.cli import dedup as dedup_cli
    from infra.cli import filter as filter_cli

    base = tmp_path_factory.mktemp("cli")
    lines = [ln.replace(b"\n", b" ").replace(b"\r", b" ") for ln in lines]
    (base / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    expected = sum(1 for ln in lines if ln.strip())
    parser = argparse.ArgumentParser()
    filter_cli.add_arguments(parser)
    assert filter_cli.run(parser.parse_args([str(base / "in.jsonl"), "--out", str(base / "f.jsonl"), "--no-langid"])) == 0
    decisions = [json.loads(x) for x in (base / "f.jsonl").read_text().splitlines()]
    assert len(decisions) == expected
    assert all(d["keep"] is (d["reason"] is None) for d in decisions)
    summary = dedup_cli.dedup_jsonl(base / "in.jsonl", base / "d.jsonl", dedup_cli.load_dedup_config(None))
    answers = [json.loads(x) for x in (base / "d.jsonl").read_text().splitlines()]
    assert len(answers) == expected == summary["docs_in"] + summary["bad_input"]
    assert sum(a["keep"] for a in answers) == summary["docs_out"]
    assert all(a["keep"] or a.get("reason") or a["cluster"] for a in answers)  # dropped: a reason or its cluster
