import json
import uuid

import pytest
from openlineage.client.event_v2 import RunState

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
