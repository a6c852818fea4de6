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


def test_stage_datasets_are_the_runs_mlflow_inputs_with_their_lineage_identity(tmp_path):
    """A stage's lineage inputs and outputs reach its MLflow run as datasets (mlflow.log_input):
    name, the content hash as digest, the source URI, the lineage node and page."""
    from flows.stage_task import node_of
    from tasks.core.hashing import sha256_tree
    from tasks.lineage.emitter import dataset_for_path
    from tasks.tracking.datasets import LINEAGE_NODE_TAG, LINEAGE_PAGE_TAG

    (tmp_path / "tokens").mkdir()
    shard, index = tmp_path / "tokens" / "train.bin", tmp_path / "tokens" / "index.json"
    shard.write_bytes(bytes(range(256)) * 4)
    index.write_text('{"splits": {"train": {"path": "train.bin"}}}')
    ckpt = tmp_path / "ckpt.txt"
    ckpt.write_text("weights")
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "tiny")
    run = tracker.start_run("train")
    inputs = [dataset_for_path(index), dataset_for_path(shard)]
    tracker.log_datasets(run, inputs + inputs[:1], [dataset_for_path(ckpt, output=True)], node_of,
                         page=lambda n: f"http://127.0.0.1:5055/#node={n}")
    logged = tracker.client.get_run(run).inputs.dataset_inputs
    by_name = {d.dataset.name: d for d in logged}
    # each once, however often the lineage lists it
    assert sorted(by_name) == [f"{tmp_path.name}/ckpt.txt", "tokens/index.json", "tokens/train.bin"]
    train = by_name["tokens/train.bin"]
    tags = {t.key: t.value for t in train.tags}
    assert tags["mlflow.data.context"] == "input" and tags[LINEAGE_NODE_TAG] == f"dataset:file:{shard.resolve()}"
    assert tags[LINEAGE_PAGE_TAG] == f"http://127.0.0.1:5055/#node=dataset:file:{shard.resolve()}"
    assert train.dataset.digest == sha256_tree(shard)[:36] and train.dataset.source_type == "local"
    assert shard.resolve().as_uri() in train.dataset.source
    assert '"bytes": 1024' in train.dataset.profile
    out = by_name[f"{tmp_path.name}/ckpt.txt"]
    assert {t.key: t.value for t in out.tags}["mlflow.data.context"] == "output"
    # the experiment opens in MLflow's model-training view, not its GenAI view
    assert tracker.client.get_experiment(tracker.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"


def test_a_dataset_without_version_facet_gets_its_content_hash_as_digest(tmp_path):
    """MLflow would make a digest up from the source URI: a local dataset without a version facet is
    hashed instead, one that cannot be hashed here is refused."""
    import pytest
    from openlineage.client.event_v2 import InputDataset

    from tasks.core.hashing import sha256_tree
    from tasks.tracking.datasets import mlflow_dataset

    data = tmp_path / "shard.bin"
    data.write_bytes(b"abc" * 100)
    entity = mlflow_dataset(InputDataset(namespace="file", name=str(data), facets={}), "n", None)
    assert entity.digest == sha256_tree(data)[:36]
    with pytest.raises(ValueError, match="no version facet"):
        mlflow_dataset(InputDataset(namespace="s3://bucket", name="raw/x.jsonl", facets={}), "n", None)


def test_prefect_view_at_line_is_rewritten_for_every_flow_entry_point():
    """Importing the flows package (every flow entry point does) installs the filter; it reads the UI
    from Prefect's settings when the line is logged and takes a loopback alias of it as the same UI."""
    import logging

    from prefect.settings import PREFECT_UI_URL, temporary_settings

    import flows  # the import installs the filter
    from tasks.tracking.links import PrefectLoginLinks

    logger = logging.getLogger("prefect.flow_runs")
    installed = [f for f in logger.filters if isinstance(f, PrefectLoginLinks)]
    assert len(installed) == 1 and installed[0].ui_base is flows.prefect_ui_base

    def shown(message: str) -> str:
        record = logger.makeRecord(logger.name, logging.INFO, __file__, 1, message, (), None)
        assert installed[0].filter(record)
        return record.getMessage()

    with temporary_settings({PREFECT_UI_URL: "http://127.0.0.1:4200"}):
        assert shown("View at http://127.0.0.1:4200/runs/flow-run/f-1") == \
            "View at http://127.0.0.1:4200/login?redirect=/runs/flow-run/f-1"
        assert shown("View at http://localhost:4200/runs/flow-run/f-2") == \
            "View at http://localhost:4200/login?redirect=/runs/flow-run/f-2"
        # another server, another port, an already rewritten line: as they are
        for other in ("View at http://example.org:4200/runs/flow-run/f-3", "View at http://localhost:4300/runs/x",
                      "View at http://127.0.0.1:4200/login?redirect=/runs/flow-run/f-1"):
            assert shown(other) == other


def test_printed_links_open_after_one_login():
    """Prefect pages go through its UI's login route (a deep link fails before the login); MLflow run
    pages name the model-training view; Prefect's own "View at" log line is rewritten the same way."""
    import logging

    from tasks.tracking.links import mlflow_run_page, prefect_page, rewrite_prefect_log_links

    ui = "http://127.0.0.1:4200/"
    assert prefect_page(ui, "/runs/flow-run/f-1") == "http://127.0.0.1:4200/login?redirect=/runs/flow-run/f-1"
    assert prefect_page(None, "/runs/flow-run/f-1") is None
    assert mlflow_run_page("http://127.0.0.1:5000", "3", "r1") == \
        "http://127.0.0.1:5000/#/experiments/3/runs/r1?workflowType=machine_learning"
    assert mlflow_run_page("sqlite:///x.db", "3", "r1") is None  # no UI for a file store
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("prefect.flow_runs")
    handler, level, filters = Keep(), logger.level, list(logger.filters)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.filters[:] = []  # (the flows package's import may have installed one already)
    try:
        rewrite_prefect_log_links(ui)
        rewrite_prefect_log_links(ui)  # installed once
        assert len(logger.filters) == 1
        logging.LoggerAdapter(logger, {}).info("View at http://127.0.0.1:4200/runs/flow-run/f-2")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.filters[:] = filters
    assert seen == ["View at http://127.0.0.1:4200/login?redirect=/runs/flow-run/f-2"]
