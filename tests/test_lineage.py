import json
import uuid
from pathlib import Path

import pytest
from openlineage.client.event_v2 import RunState

from lineage_helpers import start_service
from tasks.core.net import free_port
from tasks.lineage import JobRef, LineageEmitter, dataset_for_path, model_version_dataset
from tasks.lineage.validate import event_errors, read_events

PRODUCER = "https://github.com/crucible-ml/crucible"


def _ref(name):
    return JobRef(name, str(uuid.uuid4()))


def test_run_emits_start_and_complete_with_parent_and_versions(tmp_path):
    art = tmp_path / "shard.parquet"
    art.write_bytes(b"real bytes")
    log = tmp_path / "lineage.jsonl"
    em = LineageEmitter(log, "crucible", PRODUCER)
    root, child = _ref("pretrain"), _ref("curate.filter_and_dedup")
    with em.run(root, job_type="FLOW"):
        with em.run(child, parent=root, inputs=[dataset_for_path(art, rows=3, n_bytes=10,
                                                                 source={"name": "s", "licence": "MIT",
                                                                         "provenance": "p"})]) as run:
            run.outputs.append(dataset_for_path(art, output=True))
    events = read_events(log)
    assert [(e["job"]["name"], e["eventType"]) for e in events] == [
        ("pretrain", "START"), ("curate.filter_and_dedup", "START"),
        ("curate.filter_and_dedup", "COMPLETE"), ("pretrain", "COMPLETE")]
    for e in events:
        assert event_errors(e) == []
    complete = events[2]
    assert complete["run"]["facets"]["parent"]["run"]["runId"] == root.run_id
    assert complete["run"]["facets"]["parent"]["root"]["run"]["runId"] == root.run_id
    out = complete["outputs"][0]
    assert out["namespace"] == "file" and out["name"] == str(art.resolve())
    import hashlib
    assert out["facets"]["version"]["datasetVersion"] == hashlib.sha256(b"real bytes").hexdigest()
    assert complete["inputs"][0]["facets"]["crucible_source"]["licence"] == "MIT"


def test_failure_emits_fail_with_error_message(tmp_path):
    log = tmp_path / "lineage.jsonl"
    em = LineageEmitter(log, "crucible", PRODUCER)
    with pytest.raises(RuntimeError):
        with em.run(_ref("train.torchrun_train"), parent=_ref("train")):
            raise RuntimeError("rank 1 died")
    events = read_events(log)
    assert [e["eventType"] for e in events] == ["START", "FAIL"]
    assert events[1]["run"]["facets"]["errorMessage"]["message"] == "rank 1 died"
    assert event_errors(events[1]) == []


def test_validator_rejects_broken_events(tmp_path):
    log = tmp_path / "lineage.jsonl"
    em = LineageEmitter(log, "crucible", PRODUCER)
    em.emit(RunState.COMPLETE, _ref("x"), parent=_ref("p"),
            outputs=[model_version_dataset("http://127.0.0.1:5000", "m", 3, "abc")])
    event = read_events(log)[0]
    assert event_errors(event) == []
    assert event["outputs"][0]["namespace"] == "mlflow://127.0.0.1:5000"
    bad = json.loads(json.dumps(event))
    bad["run"]["runId"] = "not-a-uuid"
    assert event_errors(bad)
    bad = json.loads(json.dumps(event))
    del bad["run"]["facets"]["parent"]["job"]
    assert any("parent" in err for err in event_errors(bad))
    bad = json.loads(json.dumps(event))
    bad["eventType"] = "FINISHED"
    assert event_errors(bad)


# ------------------------------------------------------------------------ facets and propagation

def _parquet(path, sources):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(len(sources))],
                             "text": [f"document {i}" for i in range(len(sources))],
                             "source": sources, "language_score": [0.9] * len(sources)}), path)
    return path


SOURCES = {"web": {"name": "web", "licence": "CC-BY-4.0", "provenance": "a crawl"},
           "docs": {"name": "docs", "licence": "GPL-2.0", "provenance": "Debian packages"}}


def test_dataset_facets_and_licences_propagate_to_every_downstream_artifact(tmp_path):
    from tasks.lineage.facets import git_info

    log = tmp_path / "lineage.jsonl"
    raw = {name: tmp_path / "raw" / f"{name}.jsonl" for name in SOURCES}
    for name, p in raw.items():
        p.parent.mkdir(exist_ok=True)
        p.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n')
    root = _ref("pretrain")
    shard = _parquet(tmp_path / "ingest" / "shard-00000.parquet", ["web", "docs"])
    em = LineageEmitter(log, "crucible", PRODUCER, owner="team:auditors")
    with em.run(_ref("curate.ingest_sources"), parent=root, job_doc="reads raw files",
                code_path="tasks/ingest/stage.py") as run:
        run.inputs += [dataset_for_path(p, source=SOURCES[n]) for n, p in raw.items()]
        run.outputs.append(dataset_for_path(shard, output=True, doc="ingested documents"))
    # a later stage, with a new emitter on the same log (as each Prefect task has): its input picks up
    # the shard's licences from the log, and its outputs carry them on
    tok = tmp_path / "tokenizer" / "tokenizer.json"
    tok.parent.mkdir()
    tok.write_text("{}")
    em2 = LineageEmitter(log, "crucible", PRODUCER, owner="team:auditors")
    with em2.run(_ref("train_tokenizer.train_bpe"), parent=root, inputs=[dataset_for_path(shard)]) as run:
        run.outputs.append(dataset_for_path(tok, output=True))
    with em2.run(_ref("deploy.gate_register_serve"), parent=root, inputs=[dataset_for_path(tok)]) as run:
        run.outputs.append(model_version_dataset("http://127.0.0.1:5000", "m", 1, "abc", doc="the model"))

    events = read_events(log)
    for e in events:
        assert event_errors(e) == [], (e["job"]["name"], event_errors(e)[:3])
    ingest = events[1]
    raw_in = {i["name"]: i["facets"]["crucible_source"] for i in ingest["inputs"]}
    assert raw_in[str(raw["web"])] == {**raw_in[str(raw["web"])], "source": "web", "licence": "CC-BY-4.0",
                                       "derived": False}
    assert ingest["inputs"][0]["facets"]["dataQualityMetrics"]["rowCount"] == 3  # JSONL lines
    out = ingest["outputs"][0]
    f = out["facets"]
    assert [(c["name"], c["type"]) for c in f["schema"]["fields"]] == [
        ("id", "string"), ("text", "string"), ("source", "string"), ("language_score", "double")]
    assert f["dataQualityMetrics"]["rowCount"] == 2 and f["dataQualityMetrics"]["bytes"] == shard.stat().st_size
    assert out["outputFacets"]["outputStatistics"]["rowCount"] == 2
    assert f["documentation"]["description"] == "ingested documents"
    assert f["ownership"]["owners"] == [{"name": "team:auditors", "type": "MAINTAINER"}]
    src = f["crucible_source"]
    assert src["derived"] is True and src["licences"] == ["CC-BY-4.0", "GPL-2.0"]
    assert [s["source"] for s in src["sources"]] == ["docs", "web"]
    job = ingest["job"]["facets"]
    assert job["documentation"]["description"] == "reads raw files"
    assert job["ownership"]["owners"][0]["name"] == "team:auditors"
    if git_info()["commit"]:
        loc = job["sourceCodeLocation"]
        assert loc["type"] == "git" and loc["version"] == git_info()["commit"] and loc["path"] == "tasks/ingest/stage.py"
        assert loc["url"].startswith(("file://", "https://", "http://", "ssh://"))
    # the tokenizer's input took the shard's licences from the log; the tokenizer and the model version carry them
    bpe_start = events[3]
    assert bpe_start["inputs"][0]["facets"]["crucible_source"]["licences"] == ["CC-BY-4.0", "GPL-2.0"]
    model = events[-1]["outputs"][0]
    assert model["namespace"] == "mlflow://127.0.0.1:5000"
    assert model["facets"]["crucible_source"]["licences"] == ["CC-BY-4.0", "GPL-2.0"]
    assert model["facets"]["documentation"]["description"] == "the model"


def test_validator_checks_custom_facets_against_their_schemas(tmp_path):
    log = tmp_path / "lineage.jsonl"
    from tasks.lineage.facets import CrucibleLinksRunFacet, CrucibleStatsRunFacet

    em = LineageEmitter(log, "crucible", PRODUCER)
    em.emit(RunState.COMPLETE, _ref("x"), extra_run_facets={
        "crucible_stats": CrucibleStatsRunFacet(stage="curate", docs_in=3, docs_out=2, dropped={"c4": 1}),
        "crucible_links": CrucibleLinksRunFacet(mlflow_run_id="abc", mlflow_run_url="http://127.0.0.1:5000/#/r")})
    event = read_events(log)[0]
    assert event_errors(event) == []
    assert event["run"]["facets"]["crucible_stats"]["_schemaURL"].endswith(
        "docs/lineage-facets/CrucibleStatsRunFacet.json#/$defs/CrucibleStatsRunFacet")
    bad = json.loads(json.dumps(event))
    bad["run"]["facets"]["crucible_stats"]["docs_in"] = "three"
    assert any("crucible_stats" in err for err in event_errors(bad))
    bad = json.loads(json.dumps(event))
    del bad["run"]["facets"]["crucible_stats"]["stage"]
    assert any("crucible_stats" in err and "stage" in err for err in event_errors(bad))
    bad = json.loads(json.dumps(event))
    bad["run"]["facets"]["crucible_stats"]["_schemaURL"] = "https://example.com/elsewhere.json"
    assert any("not a Crucible facet schema" in err for err in event_errors(bad))


# ------------------------------------------------------------------------------- HTTP transport

def test_down_service_never_fails_the_run_and_replay_fills_it(tmp_path, monkeypatch):
    import subprocess
    import sys
    import time

    import httpx

    from infra.services.lineage.sample import emit_pipeline
    from tasks.core.constants import LINEAGE_TOKEN_FILE_ENV
    from tasks.lineage.transport import endpoint_url, http_stats, reset_http_stats

    # the service's write token, handed to the emitter and `crucible lineage replay` as the stack does
    (tmp_path / "token").write_text("w-t0ken\n")
    monkeypatch.setenv(LINEAGE_TOKEN_FILE_ENV, str(tmp_path / "token"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    reset_http_stats()
    # the service is down for this run: every event still reaches the JSONL log, quickly
    log = tmp_path / "run1" / "lineage.jsonl"
    t0 = time.monotonic()
    p1 = emit_pipeline(LineageEmitter(log, "crucible", PRODUCER, http_url=url, http_timeout=2), tmp_path / "run1",
                       raw_dir=tmp_path / "raw")
    assert time.monotonic() - t0 < 20
    events = read_events(log)
    stats = http_stats(endpoint_url(url))
    assert stats.sent == 0 and stats.failed >= 1 and stats.missed == len(events), stats
    assert "ConnectionError" in stats.last_error

    proc, _ = start_service(tmp_path / "lineage.db", port, token_file=tmp_path / "token")
    try:
        # the service is back when the run ends: the pretrain flow's epilogue replays the log to it
        from flows.run_context import RunContext, finish_lineage

        ctx = RunContext(run_name="run1", run_dir=str(tmp_path / "run1"), lineage_log=str(log),
                         tracking_uri="http://127.0.0.1:5000", experiment="tiny", mlflow_parent_run_id="r",
                         root_run_id=p1.root.run_id, lineage_url=url, lineage_service_url=url)
        done = finish_lineage(ctx, {"deploy": {"model_name": "crucible-tiny", "version": 1}})
        assert done["http"]["failed"] >= 1 and done["replayed"]["ingested"] == len(events), done
        assert done["output_node"] == p1.model_version_node and done["page_url"].startswith(url + "/#node=")
        assert httpx.get(f"{url}/api/v1/crucible/stats", timeout=30).json()["events"] == len(events)

        # `crucible lineage replay` afterwards: the service holds every event of the run once (it ingests
        # idempotently), and the model version's upstream graph reaches the raw files
        r = subprocess.run([sys.executable, "-m", "infra.cli", "lineage", "replay", str(log), "--url", url],
                           cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["duplicates"] == len(events)
        assert httpx.get(f"{url}/api/v1/crucible/stats", timeout=30).json()["events"] == len(events)
        graph = httpx.get(f"{url}/api/v1/lineage", params={"nodeId": p1.model_version_node,
                                                           "direction": "upstream"}).json()["graph"]
        assert {p1.file_node(f) for f in p1.raw_files} <= {n["id"] for n in graph}

        # with the service up, a run's events arrive over HTTP as they are emitted (no replay needed)
        reset_http_stats()
        log2 = tmp_path / "run2" / "lineage.jsonl"
        emit_pipeline(LineageEmitter(log2, "crucible", PRODUCER, http_url=url), tmp_path / "run2",
                      raw_dir=tmp_path / "raw", run_name="run2", version=2)
        n2 = len(read_events(log2))
        assert http_stats(endpoint_url(url)).sent == n2
        assert httpx.get(f"{url}/api/v1/crucible/stats", timeout=30).json()["events"] == len(events) + n2
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_jsonl_failure_fails_the_emit(tmp_path):
    log = tmp_path / "lineage.jsonl"
    log.mkdir()  # not writable as a file
    em = LineageEmitter(log, "crucible", PRODUCER, http_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(Exception):
        em.emit(RunState.START, _ref("x"))


# ------------------------------------------------- torchrun job and evaluation data (real runs)

@pytest.fixture(scope="module")
def lm_lineage(tmp_path_factory):
    """The lineage of a pipeline from the token shards on, emitted as the Prefect tasks emit it
    (pretrain → prepare_tokens / train / evaluate task runs): a real 1-process torchrun run launched
    by run_training with TorchrunLineage under the train task run, then a real evaluation (task suite
    on the shared WikiText-2 / LAMBADA / HellaSwag files) of its last checkpoint."""
    from lm_helpers import corpus_shards, tiny_cfg, tokenizer_artifact, tokens_artifact

    from tasks.evaluate import evaluate_checkpoint
    from tasks.lineage.artifacts import eval_data_inputs, token_split_paths
    from tasks.lineage.torchrun import TorchrunLineage, checkpoint_output
    from tasks.train import run_training

    base = tmp_path_factory.getbasetemp() / "lm"
    tok, tokens = tokenizer_artifact(base), tokens_artifact(base)
    index = Path(tokens["index_path"])
    work = tmp_path_factory.mktemp("lineage-lm")
    log = work / "lineage.jsonl"
    cfg = tiny_cfg(train={"nproc_per_node": 1, "max_steps": 4, "warmup_steps": 1, "checkpoint_every": 2,
                          "log_every": 1})
    em = LineageEmitter(log, "crucible", PRODUCER, owner="team:crucible")
    root = _ref("pretrain")
    tasks = {name: _ref(name) for name in ("train_tokenizer.train_bpe", "prepare_tokens.encode_and_pack",
                                           "train.torchrun_train", "evaluate.evaluate_checkpoint")}
    shards = [dataset_for_path(p, source={"name": "linux-doc", "licence": "GPL-2.0", "provenance": "Debian"})
              for p in corpus_shards(base)]
    with em.run(root, job_type="FLOW"):
        with em.run(tasks["train_tokenizer.train_bpe"], parent=root, inputs=shards) as run:
            run.outputs.append(dataset_for_path(tok["path"], output=True))
        with em.run(tasks["prepare_tokens.encode_and_pack"], parent=root, inputs=shards) as run:
            run.outputs += [dataset_for_path(p, output=True) for p in [index, *token_split_paths(index)]]
        task = tasks["train.torchrun_train"]
        with em.run(task, parent=root, inputs=[dataset_for_path(index)]) as run:
            torchrun = TorchrunLineage(LineageEmitter(log, "crucible", PRODUCER, owner="team:crucible"),
                                       parent=task, root=root, tokenizer=tok["path"])
            result = run_training(cfg, index, work / "train", None, None, "lineage-test", lineage=torchrun)
            run.outputs += [checkpoint_output(c) for c in result["checkpoints"]]
        ckpt = result["checkpoints"][-1]
        with em.run(tasks["evaluate.evaluate_checkpoint"], parent=root,
                    inputs=[dataset_for_path(ckpt), dataset_for_path(tok["path"]), dataset_for_path(index)]
                    + [dataset_for_path(p) for p in token_split_paths(index, ("val",))]) as run:
            report = evaluate_checkpoint(cfg, Path(ckpt), Path(tok["path"]), index, work / "evaluate" / "report.json")
            run.inputs += eval_data_inputs(report, cfg.data_root)
            run.outputs.append(dataset_for_path(report["report_path"], output=True))
    return {"log": log, "events": read_events(log), "root": root, "tasks": tasks, "torchrun": torchrun,
            "result": result, "report": report, "index": index, "tokenizer": tok["path"], "cfg": cfg, "work": work}


def test_torchrun_job_is_its_own_run_under_the_train_task(lm_lineage):
    import torch

    from tasks.core.hashing import sha256_tree
    from tasks.lineage.facets import git_info

    events, root = lm_lineage["events"], lm_lineage["root"]
    task, torchrun = lm_lineage["tasks"]["train.torchrun_train"], lm_lineage["torchrun"]
    for e in events:
        assert event_errors(e) == [], (e["job"]["name"], event_errors(e)[:3])
    order = [(e["job"]["name"], e["eventType"]) for e in events]
    job = "train.torchrun_train.torchrun"
    # START after the task started, COMPLETE before the task completed
    assert order.index((job, "START")) > order.index((task.name, "START"))
    assert order.index((job, "COMPLETE")) < order.index((task.name, "COMPLETE"))
    runs = [e for e in events if e["job"]["name"] == job]
    assert [e["eventType"] for e in runs] == ["START", "COMPLETE"]
    for e in runs:
        assert e["run"]["runId"] == torchrun.run_id != task.run_id
        parent = e["run"]["facets"]["parent"]
        assert parent["run"]["runId"] == task.run_id and (parent["job"]["namespace"], parent["job"]["name"]) == ("crucible", task.name)
        assert parent["root"]["run"]["runId"] == root.run_id and parent["root"]["job"]["name"] == "pretrain"
        jt = e["job"]["facets"]["jobType"]
        assert (jt["processingType"], jt["integration"], jt["jobType"]) == ("BATCH", "TORCH", "JOB")
        engine = e["run"]["facets"]["processing_engine"]
        assert engine["name"] == "torch" and engine["version"] == torch.__version__
        config = e["run"]["facets"]["crucible_config"]["config"]
        assert config["train"]["max_steps"] == 4 and config["model"]["n_layer"] == 2
        assert e["job"]["facets"]["documentation"]["description"].startswith("torchrun job")
        if git_info()["commit"]:
            assert e["job"]["facets"]["sourceCodeLocation"]["path"] == "tasks/train/worker.py"
    start, complete = runs
    index = lm_lineage["index"]
    inputs = {i["name"] for i in start["inputs"]}
    assert inputs == {str(index.resolve()), str((index.parent / "train.bin").resolve()),
                      str(Path(lm_lineage["tokenizer"]).resolve())}
    # the token shards' and tokenizer's licences (recorded by their producers in the log) reach the checkpoints
    assert all(i["facets"]["crucible_source"]["licences"] == ["GPL-2.0"] for i in complete["inputs"])
    ckpts = lm_lineage["result"]["checkpoints"]
    assert [Path(c).name for c in ckpts] == ["step-000002", "step-000004"]
    outputs = {o["name"]: o for o in complete["outputs"]}
    assert set(outputs) == {*ckpts, str((lm_lineage["work"] / "train" / "train_log.jsonl").resolve())}
    for c in ckpts:
        assert outputs[c]["facets"]["version"]["datasetVersion"] == sha256_tree(c)
        assert outputs[c]["facets"]["crucible_source"]["licences"] == ["GPL-2.0"]
        assert outputs[c]["facets"]["ownership"]["owners"][0]["name"] == "team:crucible"


def test_lineage_graph_connects_token_shards_through_torchrun_to_checkpoints(lm_lineage, tmp_path):
    from fastapi.testclient import TestClient

    from infra.services.lineage import create_app
    from tasks.lineage.replay import replay

    with TestClient(create_app(tmp_path / "lineage.db", write_token="t"), headers={"Authorization": "Bearer t"}) as client:
        assert replay(lm_lineage["log"], "http://testserver", client=client)["ingested"] == len(lm_lineage["events"])
        train_bin = f"dataset:file:{(lm_lineage['index'].parent / 'train.bin').resolve()}"
        resp = client.get("/api/v1/lineage", params={"nodeId": train_bin, "direction": "downstream", "depth": 1})
        assert resp.status_code == 200, resp.text
        graph = {n["id"]: n for n in resp.json()["graph"]}
    job = "job:crucible:train.torchrun_train.torchrun"
    assert {e["origin"] for e in graph[job]["inEdges"]} >= {train_bin}
    assert {e["destination"] for e in graph[job]["outEdges"]} >= {
        f"dataset:file:{c}" for c in lm_lineage["result"]["checkpoints"]}


def test_evaluation_data_are_inputs_with_licence_and_content_hash(lm_lineage):
    from tasks.core.hashing import sha256_file
    from tasks.lineage.facets import data_readme_entry

    events, report, cfg = lm_lineage["events"], lm_lineage["report"], lm_lineage["cfg"]
    complete = next(e for e in events if e["job"]["name"] == "evaluate.evaluate_checkpoint"
                    and e["eventType"] == "COMPLETE")
    inputs = {i["name"]: i for i in complete["inputs"]}
    assert str((lm_lineage["index"].parent / "val.bin").resolve()) in inputs
    used = {name: str(Path(info["data"]).resolve()) for name, info in report["tasks"].items() if "data" in info}
    assert set(used) == {"wikitext", "lambada", "hellaswag"}
    for task, path in used.items():
        ds = inputs[path]
        readme = data_readme_entry(path, cfg.data_root)
        # the content hash is the file's sha256, which is the one the data README lists
        assert ds["facets"]["version"]["datasetVersion"] == sha256_file(path) == readme["sha256"]
        src = ds["facets"]["crucible_source"]
        assert src["use"] == "evaluation" and not src["derived"] and src["source"] == task
        assert src["licence"] == readme["licence"] and readme["sha256"] in src["provenance"]
    assert "CC BY 4.0" in inputs[used["lambada"]]["facets"]["crucible_source"]["licence"]
    # benchmark licences are recorded, not propagated: the report carries the training data's only
    out = complete["outputs"][0]
    assert out["facets"]["crucible_source"]["licences"] == ["GPL-2.0"]


def test_trace_lists_evaluation_data_apart_from_sources(lm_lineage, tmp_path):
    from infra.services.lineage.provenance import Provenance, report_markdown
    from infra.services.lineage.store import LineageStore

    store = LineageStore(tmp_path / "lineage.db")
    try:
        store.ingest_batch(lm_lineage["events"])
        node = f"dataset:file:{lm_lineage['report']['report_path']}"
        trace = Provenance(store).trace(node)
        assert {s["source"] for s in trace["sources"]} == {"linux-doc"} and trace["unlicensed"] == []
        assert sorted(d["task"] for d in trace["evaluationData"]) == ["hellaswag", "lambada", "wikitext"]
        assert all(d["licence"] and d["readBy"] == ["evaluate.evaluate_checkpoint"] for d in trace["evaluationData"])
        md = report_markdown(Provenance(store).report(node))
        assert "## Evaluation data" in md and "HellaSwag MIT" in md
    finally:
        store.close()


def test_failed_torchrun_job_emits_fail_with_the_error(lm_lineage, tmp_path):
    from lm_helpers import tiny_cfg

    from tasks.lineage.torchrun import TorchrunLineage
    from tasks.train import TrainingError, run_training

    log = tmp_path / "lineage.jsonl"
    task, root = _ref("train.torchrun_train"), _ref("pretrain")
    torchrun = TorchrunLineage(LineageEmitter(log, "crucible", PRODUCER), parent=task, root=root)
    # seq_len longer than the train split: the worker cannot draw a window and torchrun exits non-zero
    cfg = tiny_cfg(model={"seq_len": 1 << 20}, train={"nproc_per_node": 1})
    with pytest.raises(TrainingError):
        run_training(cfg, lm_lineage["index"], tmp_path / "fail", None, None, "fail", lineage=torchrun)
    events = read_events(log)
    assert [e["eventType"] for e in events] == ["START", "FAIL"]
    fail = events[1]
    assert event_errors(fail) == []
    assert fail["run"]["runId"] == torchrun.run_id and fail["run"]["facets"]["parent"]["run"]["runId"] == task.run_id
    assert "torchrun exited with code" in fail["run"]["facets"]["errorMessage"]["message"]
    assert fail["outputs"] == []


# ------------------------------------------ the dedup index and the served model as datasets

def test_curate_reads_and_writes_the_dedup_index_as_a_versioned_dataset(ray_session, tmp_path):
    """With a persistent MinHash index, each curate run reads the index as it found it and writes
    the next generation: one dataset, its version the index generation, input and output of the job."""
    import gzip

    from tasks.config import PipelineConfig
    from tasks.core.documents import write_docs
    from tasks.core.layout import RunLayout
    from tasks.core.sections import stage_config
    from tasks.core.stage import StageContext, StageInputs
    from tasks.curate.stage import CurateStage
    from tasks.config import DEFAULT_DATA_ROOT

    cc_main = Path(DEFAULT_DATA_ROOT) / "web" / "cc-main-2019-30-sample.jsonl.gz"
    if not cc_main.exists():
        pytest.skip(f"no {cc_main}")
    with gzip.open(cc_main, "rt", encoding="utf-8") as f:
        texts = [t for t in (json.loads(line)["text"] for line, _ in zip(f, range(200))) if len(t.split()) > 200][:6]
    off = {"enabled": False}
    cfg = PipelineConfig.model_validate({
        "name": "index-lineage", "data_root": str(DEFAULT_DATA_ROOT), "ray": {"num_cpus": 2},
        "sources": [{"name": "cc", "uri": "web/*", "format": "jsonl", "licence": "CC", "provenance": "p"}],
        "curate": {"langid": off, "gopher_quality": off, "gopher_repetition": off, "c4": off, "fineweb": off,
                   "decontam": off, "pii": off, "resume": False,
                   "dedup": {"minhash": {"clustering": "local", "index_dir": str(tmp_path / "index")}}}})
    stage, index = CurateStage(), str((tmp_path / "index").resolve())
    em = LineageEmitter(tmp_path / "lineage.jsonl", "crucible", PRODUCER)
    versions = []
    for cycle, docs in enumerate((texts[:3], texts[3:] + texts[:1])):  # cycle 2 repeats one of cycle 1
        shards = write_docs([{"id": f"c{cycle}-{i}", "text": t, "source": "cc"} for i, t in enumerate(docs)],
                            tmp_path / f"in{cycle}")
        inputs = StageInputs(shards=[str(s) for s in shards])
        started = stage.input_datasets(cfg, inputs)
        ctx = StageContext(layout=RunLayout(tmp_path / f"run{cycle}"), run_name=f"r{cycle}",
                           tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="x")
        result = stage.run(stage_config(stage, cfg), inputs, ctx)
        read = {d.name: d for d in started + result.inputs if d.name == index}
        written = [d for d in result.outputs if d.name == index]
        assert len(written) == 1 and written[0].facets["dataQualityMetrics"].rowCount == 3 * (cycle + 1)
        versions.append(written[0].facets["version"].datasetVersion)
        if cycle == 0:
            assert not read and result.data["dropped"].get("minhash_index", 0) == 0
        else:
            assert read[index].facets["version"].datasetVersion == versions[0]  # the generation cycle 1 wrote
            assert result.data["dropped"]["minhash_index"] == 1
        em.emit(RunState.COMPLETE, _ref("curate.filter_and_dedup"), inputs=started + result.inputs,
                outputs=result.outputs)
    assert versions == ["gen-000001", "gen-000002"]
    events = read_events(tmp_path / "lineage.jsonl")
    assert all(event_errors(e) == [] for e in events)


def test_served_model_is_a_dataset_with_endpoint_and_model_version(tmp_path):
    """A deployment that registered and served a model writes two datasets: the model version in the
    registry and the served model (namespace the server, name models/<name>, version the model version)."""
    from tasks.deploy.stage import deploy_outputs

    served = {"model_name": "m", "version": 3, "content_hash": "abc", "alias": "champion",
              "endpoint": "http://127.0.0.1:8123/v1"}
    outputs = deploy_outputs("http://127.0.0.1:5000", served)
    assert [(o.namespace, o.name) for o in outputs] == [("mlflow://127.0.0.1:5000", "models/m/3"),
                                                        ("http://127.0.0.1:8123", "models/m")]
    serving = outputs[1].facets
    assert serving["version"].datasetVersion == "3"
    assert (serving["crucible_serving"].endpoint, serving["crucible_serving"].model_version) == (served["endpoint"], 3)
    em = LineageEmitter(tmp_path / "lineage.jsonl", "crucible", PRODUCER)
    em.emit(RunState.COMPLETE, _ref("deploy-model"), outputs=outputs)
    assert event_errors(read_events(tmp_path / "lineage.jsonl")[0]) == []
    # not served (deploy.serve false, or the gate kept the champion): the registry's version alone, or nothing
    assert [o.name for o in deploy_outputs("http://127.0.0.1:5000", {**served, "endpoint": None})] == ["models/m/3"]
    assert deploy_outputs("http://127.0.0.1:5000", {**served, "version": None}) == []


def test_training_run_of_finds_the_producer_of_a_store_checkpoint_by_its_key(tmp_path):
    """On an object-store run_root a checkpoint is named in lineage by its key, not the working-copy
    path the triggered flows hold: the torchrun run whose COMPLETE lists it is still found (not just
    the newest torchrun run, which may be a later one)."""
    from tasks.core import storage
    from tasks.lineage.runs import training_run_of
    from tasks.lineage.signed import sign_event

    store = storage.open_store("s3://bucket/crucible", {}, str(tmp_path / "cache"))
    try:
        ckpt = store.local_root / "r1" / "train" / "checkpoints" / "step-000004"
        job = {"name": "pretrain.torchrun_train.torchrun",
               "facets": {"jobType": {"integration": "TORCH", "jobType": "JOB", "processingType": "BATCH"}}}
        events = [{"eventType": "START", "run": {"runId": "first"}, "job": job},
                  {"eventType": "COMPLETE", "run": {"runId": "first"}, "job": job,
                   "outputs": [{"namespace": "s3://bucket", "name": "crucible/r1/train/checkpoints/step-000004"}]},
                  {"eventType": "START", "run": {"runId": "second"}, "job": job}]
        # ... and one a writer of the run directory appended, naming its own run as the producer: refused
        forged = [{"eventType": "START", "run": {"runId": "forged"}, "job": job},
                  {**events[1], "run": {"runId": "forged"}}]
        log = tmp_path / "lineage.jsonl"
        log.write_text("".join(json.dumps(sign_event(e)) + "\n" for e in events) +
                       "".join(json.dumps(e) + "\n" for e in forged))
        assert training_run_of(log, ckpt).run.run_id == "first"
    finally:
        storage._STORES.pop(store.root, None)


# ------------------------------------------------- the log as a record nobody else can write (issue 24)

def test_a_forged_or_altered_line_is_never_replayed_nor_trusted(tmp_path, caplog):
    """Lines a writer of the run directory appends to lineage.jsonl (a valid event of its own, a
    genuine line with its content changed, a made-up signature) are refused by every reader: never
    sent to the lineage service with the write token, never a licence the emitter propagates, never
    a parent the triggered flows take (test above)."""
    from fastapi.testclient import TestClient

    from infra.services.lineage import create_app
    from tasks.lineage.replay import iter_events, replay

    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"text": "a"}\n')
    log = tmp_path / "lineage.jsonl"
    em = LineageEmitter(log, "crucible", PRODUCER)
    with em.run(_ref("pretrain"), job_type="FLOW"):
        pass
    genuine = read_events(log)
    assert all(event_errors(e) == [] for e in genuine)
    # a valid OpenLineage event (the service would store it) claiming a licence for the raw file
    from tasks.lineage.facets import custom_schema_url

    forged = {**genuine[0], "run": {"runId": str(uuid.uuid4())}, "inputs": [
        {"namespace": "file", "name": str(raw.resolve()),
         "facets": {"crucible_source": {"_producer": PRODUCER,
                                        "_schemaURL": custom_schema_url("CrucibleSourceDatasetFacet"),
                                        "source": "x", "licence": "Public-Domain", "provenance": "trust me",
                                        "derived": False, "licences": ["Public-Domain"], "sources": []}}}]}
    assert event_errors(forged) == []
    altered = json.loads(json.dumps(genuine[1]))  # the genuine line's signature kept, its content changed
    altered["run"]["runId"], altered["job"]["name"] = str(uuid.uuid4()), "deploy.gate_register_serve"
    with log.open("a") as f:
        for e in (forged, altered):
            f.write(json.dumps(e) + "\n")
    token = "w-t0ken"
    with TestClient(create_app(tmp_path / "l.db", write_token=token),
                    headers={"Authorization": f"Bearer {token}"}) as c:
        got = replay(log, "http://testserver", client=c, token=token)
        assert c.get("/api/v1/crucible/stats").json()["events"] == 2  # the genuine ones only
        assert (got["events"], got["ingested"], got["refused"]) == (2, 2, 2), got
        assert "refused" in caplog.text and "forged, or altered" in caplog.text
        made_up = json.loads(json.dumps(genuine[1]))  # a signature of the right form, made up
        made_up["run"]["runId"] = str(uuid.uuid4())
        made_up["run"]["facets"]["crucible_signature"]["signature"] = "hmac-sha256:" + "0" * 64
        with log.open("a") as f:
            f.write(json.dumps(made_up) + "\nnot json\n")
        got = replay(log, "http://testserver", client=c, token=token)
        assert (got["events"], got["duplicates"], got["refused"]) == (2, 2, 4), got
        assert c.get("/api/v1/crucible/stats").json()["events"] == 2
    refused: list = []
    assert [e["run"]["runId"] for e in iter_events(log, refused)] == [e["run"]["runId"] for e in genuine]
    assert refused == [3, 4, 5, 6]
    # the emitter's licence propagation reads the same log: the forged licence is not taken
    with em.run(_ref("curate.ingest_sources"), inputs=[dataset_for_path(raw)]) as run:
        run.outputs.append(dataset_for_path(tmp_path / "out.parquet", output=True, inspect=False))
    last = json.loads(log.read_text().splitlines()[-1])
    assert "crucible_source" not in last["inputs"][0]["facets"]
    assert "crucible_source" not in last["outputs"][0]["facets"]


def test_a_hostile_line_is_refused_and_the_log_read_goes_on(tmp_path, caplog):
    """A line whose signature has a non-ASCII character (hmac.compare_digest raised TypeError) or
    whose content has a lone surrogate escape (its canonical bytes raised UnicodeEncodeError) is
    refused with a reason like any unsigned line; the lines after it are still read."""
    from tasks.core.signing import SignatureError, verify_bytes
    from tasks.lineage.replay import iter_events

    log = tmp_path / "lineage.jsonl"
    em = LineageEmitter(log, "crucible", PRODUCER)
    with em.run(_ref("pretrain"), job_type="FLOW"):
        pass
    genuine = read_events(log)
    non_ascii = json.loads(json.dumps(genuine[1]))
    non_ascii["run"]["runId"] = str(uuid.uuid4())
    non_ascii["run"]["facets"]["crucible_signature"]["signature"] = "hmac-sha256:" + "\u00e9" * 64
    surrogate = json.dumps(genuine[1]).replace('"pretrain', '"\\ud800pretrain', 1)
    assert "\\ud800" in surrogate
    text = log.read_text()
    log.write_text(json.dumps(non_ascii) + "\n" + surrogate + "\n" + text)
    refused: list = []
    assert [e["run"]["runId"] for e in iter_events(log, refused)] == [e["run"]["runId"] for e in genuine]
    assert refused == [1, 2]
    assert caplog.text.count("refused") >= 2
    for signature in ("\u00e9" * 64, b"hmac", 7):
        with pytest.raises(SignatureError, match="not an ASCII"):
            verify_bytes(b"{}", signature, "lineage-line")


def test_a_symlinked_log_never_makes_the_pipeline_write_to_its_target(tmp_path):
    """lineage.jsonl replaced by a link (or the run directory by one) makes the emit fail: the
    pipeline's events are never appended to the file the link names."""
    from tasks.lineage.replay import replay

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "lineage.jsonl").symlink_to(victim)
    em = LineageEmitter(run / "lineage.jsonl", "crucible", PRODUCER)
    with pytest.raises(Exception, match="symbolic link"):
        em.emit(RunState.START, _ref("pretrain"))
    assert victim.read_text() == "precious\n"
    with pytest.raises(OSError, match="symbolic link"):  # nor is a linked file read and replayed
        replay(run / "lineage.jsonl", "http://127.0.0.1:9")
    # the run directory itself a link to a folder outside the run root
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r1").symlink_to(elsewhere, target_is_directory=True)
    em = LineageEmitter(tmp_path / "runs" / "r1" / "lineage.jsonl", "crucible", PRODUCER)
    with pytest.raises(Exception, match="symbolic link"):
        em.emit(RunState.START, _ref("pretrain"))
    assert list(elsewhere.iterdir()) == []


def test_a_store_checkpoint_is_versioned_from_its_signed_manifest_without_reading_it_back(tmp_path, monkeypatch):
    """The train stage's outputs on a store: each checkpoint's lineage version is its tree hash as
    the run's signed manifest records it (equal to hashing its files), with no object read back."""
    from lm_helpers import random_checkpoint, sample_tokenizer
    from s3_helpers import moto_s3
    from tasks.core import fs, storage
    from tasks.core.hashing import sha256_tree
    from tasks.lineage.torchrun import checkpoint_output

    tok = sample_tokenizer(tmp_path / "tokenizer.json")
    ckpt = random_checkpoint(tmp_path / "train", tok, 4, 0)
    monkeypatch.setattr(storage, "_STORES", {})
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        for p in ckpt.parent.rglob("*"):
            if p.is_file():
                s3.client.upload_file(str(p), "runs", f"crucible/r1/train/checkpoints/{p.relative_to(ckpt.parent).as_posix()}")
        storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        uri = f"s3://runs/crucible/r1/train/checkpoints/{ckpt.name}"
        monkeypatch.setattr(fs, "sha256", lambda *a, **k: pytest.fail("an object was read back to hash it"))
        ds = checkpoint_output(uri)
        assert ds.facets["version"].datasetVersion == sha256_tree(ckpt)
        assert (ds.namespace, ds.name) == ("s3://runs", f"crucible/r1/train/checkpoints/{ckpt.name}")


def test_a_triggered_flow_finds_the_training_run_in_the_log_on_the_store(tmp_path, monkeypatch):
    """triggered_lineage reads an object-store run's lineage log where it lives (its URI: this worker's
    working copy may not be the machine's that ran the stages). The training run of the checkpoint is
    found there, so the triggered runs are parented to it (a URI made a Path is no file: none was)."""
    from s3_helpers import moto_s3
    from tasks.core import storage
    from tasks.lineage.runs import training_run_of
    from tasks.lineage.signed import sign_event

    job = {"name": "pretrain.torchrun_train.torchrun",
           "facets": {"jobType": {"integration": "TORCH", "jobType": "JOB", "processingType": "BATCH"}}}
    ckpt = "s3://runs/crucible/r1/train/checkpoints/step-000004"
    events = [{"eventType": "START", "run": {"runId": "trained-it"}, "job": job},
              {"eventType": "COMPLETE", "run": {"runId": "trained-it"}, "job": job,
               "outputs": [{"namespace": "s3://runs", "name": "crucible/r1/train/checkpoints/step-000004"}]}]
    monkeypatch.setattr(storage, "_STORES", {})
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        s3.client.put_object(Bucket="runs", Key="crucible/r1/lineage.jsonl",
                             Body="".join(json.dumps(sign_event(e)) + "\n" for e in events).encode())
        storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        assert training_run_of("s3://runs/crucible/r1/lineage.jsonl", ckpt).run.run_id == "trained-it"
