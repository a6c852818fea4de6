from tasks.tracking import Tracker, flatten


def test_flatten_nested_config():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": "x"}) == {"a.b": "1", "a.c": "[1, 2]", "d": "x"}


def test_parent_and_nested_stage_runs(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "tiny")
    parent = tracker.start_run("run-1")
    tracker.log_params(parent, {"train": {"max_steps": 5}, "sources": [{"name": "a"}]})
    stage = tracker.start_run("curate", parent_run_id=parent)
    tracker.log_metrics(stage, {"docs_in": 10, "docs_out": 7, "flag": True, "nan": float("nan")})
    tracker.end_run(stage)
    tracker.end_run(parent)
    again = Tracker(uri, "tiny")  # same experiment is reused, not duplicated
    assert again.experiment_id == tracker.experiment_id
    run = tracker.client.get_run(stage)
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.metrics == {"docs_in": 10.0, "docs_out": 7.0}
    assert tracker.client.get_run(parent).data.params["train.max_steps"] == "5"
    assert run.info.status == "FINISHED"
