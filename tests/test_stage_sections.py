"""A stage reads the config sections its `run` signature names, and only those (tasks/core/sections.py):
the stage wrapper's tree withholds the others, and the lineage `crucible_config` facet lists exactly
the named ones."""
from __future__ import annotations

import copy
import pickle
from typing import Annotated

import pytest

from infra.settings import CrucibleConfig
from lm_helpers import tiny_cfg
from tasks.config import INFRA_SECTIONS, PipelineConfig
from tasks.core.sections import SECTIONS, Reads, UndeclaredSection, stage_config, stage_sections
from tasks.core.stage import Stage, StageResult
from tasks.registry import STAGES


class TrainOnly(Stage):
    name, task, flow, doc = "train_only", "train_only", "train", "reads train"

    def run(self, cfg: Annotated[PipelineConfig, Reads("train")], inputs, ctx) -> StageResult:
        return StageResult({"max_steps": cfg.train.max_steps, "model_name": cfg.deploy.model_name})


class NoDeclaration(Stage):
    name, task, flow, doc = "undeclared", "undeclared", "train", "declares nothing"

    def run(self, cfg, inputs, ctx) -> StageResult:
        return StageResult({})


def test_a_stage_reading_a_section_its_signature_does_not_name_fails():
    cfg = tiny_cfg(deploy={"model_name": "m"}, stack={"prefect_port": 4321})
    given = stage_config(TrainOnly(), cfg)
    assert given.train.max_steps == cfg.train.max_steps and given.name == cfg.name  # declared, and the run's identity
    with pytest.raises(UndeclaredSection, match="train_only stage read config section 'deploy'"):
        TrainOnly().run(given, None, None)
    for read in (lambda: list(given.sources), lambda: given.sources[0], lambda: len(given.sources),
                 lambda: given.model.d_model, lambda: given.stack.prefect_port, lambda: given.lineage.namespace):
        with pytest.raises(AttributeError):  # UndeclaredSection is one: getattr(..., default) still works
            read()
    assert TrainOnly().run(cfg, None, None).data["model_name"] == "m"  # the whole tree: nothing withheld
    assert cfg.deploy.model_name == "m" and list(cfg.sources)  # the wrapper's copy leaves the tree alone


def test_withheld_sections_still_serialise_with_their_values():
    """A stage may hand its config on whole (training's config file, the model card): dumps, copies
    and pickles carry the real values; a pickled copy (a Ray task's) is the plain section."""
    cfg = tiny_cfg(deploy={"model_name": "m"})
    given = stage_config(TrainOnly(), cfg)
    assert given.model_dump(mode="json") == cfg.model_dump(mode="json")
    assert CrucibleConfig.model_validate_json(given.model_dump_json()) == cfg
    assert pickle.loads(pickle.dumps(given)).deploy.model_name == "m"
    for copied in (given.model_copy(deep=True), given.model_copy(), copy.deepcopy(given)):  # copies stay withheld
        with pytest.raises(UndeclaredSection):
            copied.deploy.model_name
        with pytest.raises(UndeclaredSection, match="'sources'"):
            list(copied.sources)
        assert copied.model_dump(mode="json") == cfg.model_dump(mode="json")
    assert pickle.loads(pickle.dumps(given)).sources[0].name == "test"


def test_every_stage_names_its_sections_and_the_facet_records_exactly_those():
    from flows.stage_task import run_facets

    cfg = tiny_cfg()
    dumped = cfg.model_dump(mode="json")
    assert not hasattr(Stage, "reads")
    for name, stage in STAGES.items():
        sections = stage_sections(stage)
        assert sections and set(sections) <= set(SECTIONS) and not set(sections) & set(INFRA_SECTIONS), name
        facet = run_facets(cfg, stage, {"docs_in": 1, "docs_out": 1, "val_loss": 1.0, "perplexity": 2.7, "step": 1})
        assert facet["crucible_config"].config == {k: dumped[k] for k in sections}, name
        given = stage_config(stage, cfg)
        for section in set(type(cfg).model_fields) - set(sections) - {"name", "data_root", "run_root"}:
            with pytest.raises(AttributeError):
                value = getattr(given, section)
                list(value) if isinstance(value, list) else getattr(value, next(iter(type(value).model_fields)))
    facet = run_facets(cfg, TrainOnly(), {})
    assert list(facet["crucible_config"].config) == ["train"]


def test_the_declaration_is_checked():
    with pytest.raises(TypeError, match="Reads"):
        stage_sections(NoDeclaration())
    with pytest.raises(ValueError, match="stack"):
        Reads("train", "stack")  # the stack's sections are infra's, never a stage's


def test_the_stage_wrapper_hands_the_stage_the_narrowed_tree(tmp_path, monkeypatch):
    """flows/stage_task.py's run_stage itself (its Prefect task body), with a registered stage that
    reads a section it does not declare: it raises UndeclaredSection; handed the whole tree it would not."""
    import types
    import uuid

    import flows.stage_task as stage_task
    from flows.run_context import RunContext
    from tasks.core.stage import StageInputs

    monkeypatch.setitem(STAGES, "train_only", TrainOnly())
    # only Prefect's runtime ids stand in (no flow run here); MLflow, lineage and energy are the real ones
    monkeypatch.setattr(stage_task, "flow_run", types.SimpleNamespace(flow_name="train", id=str(uuid.uuid4())))
    monkeypatch.setattr(stage_task, "task_run", types.SimpleNamespace(task_name="train_only", id=str(uuid.uuid4())))
    run = RunContext(run_name="r", run_dir=str(tmp_path / "run"), lineage_log=str(tmp_path / "run" / "lineage.jsonl"),
                     tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="e", mlflow_parent_run_id="",
                     root_run_id=str(uuid.uuid4()))
    cfg = tiny_cfg(deploy={"model_name": "m"})
    with pytest.raises(UndeclaredSection, match="train_only stage read config section 'deploy'"):
        stage_task.run_stage.fn("train_only", cfg, run, StageInputs())
