"""The stage registry and the one Stage shape: every stage is listed once with a typed result,
the flows are built from the registry, RunLayout knows the run's paths, and a stage runs as plain
Python (no Prefect) from its registry entry."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.config import PipelineConfig
from tasks.core.layout import RunLayout
from tasks.core.sections import stage_config, stage_sections
from tasks.core.stage import Markdown, PlanResult, Stage, StageContext, StageInputs, StageResult
from tasks.registry import ALL_STAGES, FLOW_DOCS, PRETRAIN_FLOWS, STAGES, stage


def test_every_stage_has_one_entry_and_the_full_shape():
    assert len(STAGES) == len(ALL_STAGES)  # no two stages share a name (the dict would keep only one)
    tasks = [s.task for s in STAGES.values()]
    assert len(set(tasks)) == len(tasks)  # a Prefect task / lineage job name belongs to one stage
    sections = set(PipelineConfig.model_fields)
    for name, s in STAGES.items():
        assert isinstance(s, Stage) and s.name == name
        assert type(s).run is not Stage.run, f"{name} does not implement run"
        assert issubclass(s.result_type, StageResult)
        assert set(stage_sections(s)) <= sections, f"{name} reads unknown config sections"  # Reads checks them too
        assert s.doc and s.flow in FLOW_DOCS
    assert [s.name for f in PRETRAIN_FLOWS for s in f.stages] == [
        "ingest", "curate", "quality", "tokenizer", "tokens", "plan", "train", "evaluate", "deploy"]
    with pytest.raises(KeyError, match="registered"):
        stage("nope")


def test_pretrain_flow_has_a_subflow_per_registry_flow():
    import flows.pretrain as pretrain

    subflows = {getattr(pretrain, n).name for n in dir(pretrain) if hasattr(getattr(pretrain, n), "fn")}
    assert {f.name for f in PRETRAIN_FLOWS} | {"pretrain"} == subflows


def test_run_layout_paths(tmp_path):
    layout = RunLayout.for_run(tmp_path / "runs", "r1")
    ckpt = layout.checkpoints_dir / "step-000010"
    assert RunLayout.of_checkpoint(ckpt) == layout and layout.run_name == "r1"
    assert layout.tokenizer_file == layout.run_dir / "tokenizer" / "tokenizer.json"
    assert layout.tokens_index == layout.run_dir / "tokens" / "index.json"
    assert layout.triggered_eval_report(ckpt) == layout.run_dir / "evaluate" / "triggered" / "step-000010.json"
    assert layout.triggered_deploy_record(ckpt).parent == layout.run_dir / "deploy" / "triggered"
    assert not layout.stage_dir("plan", create=False).exists() and layout.stage_dir("plan").is_dir()
    for outside in (tmp_path / "step-1", tmp_path / "x" / "checkpoints" / "step-1"):
        assert not RunLayout.is_run_checkpoint(outside)
        with pytest.raises(ValueError, match="not a pipeline checkpoint"):
            RunLayout.of_checkpoint(outside)


def test_plan_stage_runs_as_plain_python(base, tmp_path):
    """The registry's plan stage, run without Prefect: its typed result, file, lineage output and report."""
    from lm_helpers import tiny_cfg, tokens_artifact

    index = tokens_artifact(base)["index_path"]
    layout = RunLayout.for_run(tmp_path, "plain")
    result = STAGES["plan"].run(stage_config(STAGES["plan"], tiny_cfg()), StageInputs(tokens_index=index),
                                StageContext(layout=layout, run_name="plain", tracking_uri="", experiment="x"))
    assert isinstance(result, PlanResult) and Path(result.path) == layout.plan_file
    written = json.loads(layout.plan_file.read_text())
    assert written["params"] == result.data["params"] > 0 and written["tokens"] == result.data["tokens"]
    assert [o.name for o in result.outputs] == [str(layout.plan_file)]
    assert isinstance(result.reports[0], Markdown) and f"{result.data['params']:,} parameters" in result.reports[0].markdown
