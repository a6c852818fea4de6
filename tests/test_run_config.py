"""The triggered flows take a run's config from the stack's registered, signed copy (issue 24).

The run directory's config.json is writable by anyone who can write the run directory: pointed at
by the evaluate-checkpoint / deploy-model flows, it let a writer point `lineage.http_url` at itself
(and receive the lineage write token), point `evaluate.wikitext.path` at any file (copied into the
gate's yardstick set) or loosen the gate. The pretrain flow registers the resolved config, signed,
in the stack's state directory when it opens the run; the flows load that copy only."""
from __future__ import annotations

import json

import pytest

from flows.run_context import register_config
from flows.triggers import _load_cfg, run_paths
from infra import stack
from lm_helpers import tiny_cfg
from infra.settings import StackConfig
from tasks.core.layout import RunLayout
from tasks.deploy.triggered import ForgedClaim


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv(stack.STATE_DIR_ENV, str(tmp_path / "state"))
    cfg = tiny_cfg(deploy={"max_val_loss": 7.5}).model_copy(update={"run_root": str(tmp_path / "runs")})
    layout = RunLayout.for_run(cfg.run_root, "r1")
    layout.run_dir.mkdir(parents=True)
    layout.config_file.write_text(cfg.model_dump_json(indent=2))  # what open_run writes, and registers:
    assert register_config(cfg, layout.run_dir) == stack.run_config_file(StackConfig(), layout.run_dir)
    return cfg, layout, run_paths(layout.checkpoints_dir / "step-000010")


def test_an_altered_config_json_is_not_what_the_triggered_flows_use(run, tmp_path):
    cfg, layout, paths = run
    forged = json.loads(layout.config_file.read_text())
    forged["lineage"]["http_url"] = "http://attacker.example:8080"
    forged["evaluate"]["wikitext"]["path"] = str(tmp_path / "state" / "secrets" / "signing.key")
    forged["deploy"]["max_val_loss"] = 1e9
    layout.config_file.write_text(json.dumps(forged))
    loaded = _load_cfg(paths)
    assert loaded.lineage.http_url is None and loaded.deploy.max_val_loss == 7.5
    assert loaded.evaluate.wikitext.path == cfg.evaluate.wikitext.path
    assert loaded == cfg
    layout.config_file.unlink()  # nor is the file needed at all
    assert _load_cfg(paths) == cfg


def test_a_registered_copy_that_is_altered_unsigned_missing_or_another_runs_is_refused(run, tmp_path, caplog):
    cfg, layout, paths = run
    path = stack.run_config_file(StackConfig(), layout.run_dir)
    signed = json.loads(path.read_text())
    altered = json.loads(json.dumps(signed))
    altered["config"]["lineage"]["http_url"] = "http://attacker.example:8080"
    unsigned = {k: v for k, v in altered.items() if k != "signature"}
    for record in (altered, unsigned):
        path.write_text(json.dumps(record))
        with pytest.raises(ForgedClaim, match="refused"):
            _load_cfg(paths)
    assert "refused" in caplog.text
    path.unlink()
    with pytest.raises(ForgedClaim, match="no registered config"):
        _load_cfg(paths)
    # another run's genuine record, copied to this run's place
    other = RunLayout.for_run(cfg.run_root, "r2")
    other_cfg = cfg.model_copy(update={"name": "other"})
    register_config(other_cfg, other.run_dir)
    path.write_text(stack.run_config_file(StackConfig(), other.run_dir).read_text())
    with pytest.raises(ForgedClaim, match="not of"):
        _load_cfg(paths)
    register_config(cfg, layout.run_dir)  # the pretrain flow's own registration is what counts
    assert _load_cfg(paths) == cfg


def test_without_a_stack_nothing_is_registered(tmp_path, monkeypatch):
    """A plain `python -m flows.pretrain` (no stack, no triggered flows) writes nothing beside the runs."""
    monkeypatch.delenv(stack.STATE_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert register_config(tiny_cfg(), tmp_path / "runs" / "r1") is None
    assert list(tmp_path.iterdir()) == []
