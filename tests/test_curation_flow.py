"""`crucible curate` / the curation flow: ingest → curate → quality alone, through a real temporary
Prefect server, with the same summary (per-stage counts and timings) as `crucible run`'s, its
MLflow parent run and lineage root; and the command's fast failure on a bad config."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, PipelineConfig, load_config

REPO = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
pytestmark = pytest.mark.skipif(not (DATA / "web" / "wget-sample-0001.warc.gz").exists(),
                                reason=f"no data under {DATA}")


@pytest.fixture(scope="module")
def curation(tmp_path_factory):
    from prefect.testing.utilities import prefect_test_harness

    tmp = tmp_path_factory.mktemp("curation")
    mp = pytest.MonkeyPatch()
    mp.setenv("PREFECT_HOME", str(tmp / "prefect"))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.delenv("CRUCIBLE_STATE_DIR", raising=False)
    # tiny.yaml on its smallest source (15 wget pages); decontamination and the quality models off: lean
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"run_root={tmp / 'runs'}", "curate.decontam.enabled=false",
                                                       "quality.classifier.enabled=false", "quality.kenlm.enabled=false"])
    cfg = PipelineConfig.model_validate({**cfg.model_dump(), "sources": [
        s.model_dump() for s in cfg.sources if s.name == "wget_sample"]})
    try:
        with prefect_test_harness(server_startup_timeout=180):
            from flows.curation import run_curation

            summary = run_curation(cfg, tmp / "summary.json")
        yield {"summary": summary, "tmp": tmp, "cfg": cfg}
    finally:
        mp.undo()


def test_summary_has_the_curation_stages_counts_and_timings(curation):
    s = curation["summary"]
    assert s["status"] == "COMPLETED" and s["error"] is None
    assert json.loads((curation["tmp"] / "summary.json").read_text()) == json.loads(json.dumps(s, default=str))
    assert json.loads((Path(s["run_dir"]) / "summary.json").read_text())["stages"].keys() == s["stages"].keys()
    stages = s["stages"]
    assert list(stages) == ["ingest", "curate", "quality"] and list(s["timings_s"]) == list(stages)
    assert all(s["timings_s"][k] == stages[k]["seconds"] > 0 for k in stages)
    # the stages chain: what one stage wrote is what the next read
    assert stages["ingest"]["docs_out"] == stages["curate"]["docs_in"] > 0
    assert stages["curate"]["docs_out"] == stages["quality"]["docs_in"] > 0
    assert stages["curate"]["docs_out"] + sum(stages["curate"]["dropped"].values()) == stages["curate"]["docs_in"]
    assert [st["name"] for st in stages["curate"]["steps"]][-1] == "minhash_dedup"
    assert all(Path(p).is_file() for p in stages["quality"]["shards"])


def test_mlflow_parent_run_and_lineage_root_are_the_curation_flows(curation):
    from mlflow.tracking import MlflowClient

    from tasks.lineage.validate import read_events

    s = curation["summary"]
    run = MlflowClient(s["mlflow"]["tracking_uri"]).get_run(s["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"
    assert {"time_s.ingest", "time_s.curate", "time_s.quality", "time_s.total"} <= set(run.data.metrics)
    events = read_events(s["lineage_log"])
    flows = {e["job"]["name"] for e in events
             if e["eventType"] == "COMPLETE" and e["job"]["facets"]["jobType"]["jobType"] == "FLOW"}
    assert flows == {"curation", "curate"}


def test_every_stage_records_energy_that_sums_to_the_run_total(curation):
    """Issue 27: each stage's energy, CO2e and cost (tasks/core/energy.py) in its record, its MLflow
    run, its lineage run facet and the run's energy.jsonl; the summary's total is their sum."""
    from mlflow.tracking import MlflowClient

    from tasks.lineage.validate import event_errors, read_events

    s = curation["summary"]
    assert s["energy"] is not None, "no stage recorded energy (energy.enabled off?)"
    stages = s["stages"]
    assert list(s["energy"]["stages"]) == list(stages) == ["ingest", "curate", "quality"]
    client = MlflowClient(s["mlflow"]["tracking_uri"])
    for name, data in stages.items():
        e = data["energy"]
        assert e["kwh"] > 0 and e["cpu_core_seconds"] > 0 and e["cost_usd"] > 0, (name, e)
        assert e["kwh"] == pytest.approx(e["cpu_kwh"] + e["gpu_kwh"])
        assert e["co2e_kg"] > 0 and e["co2e_kg"] == pytest.approx(e["kwh"] * e["grid_gco2e_per_kwh"] / 1000)
        assert s["energy"]["stages"][name]["kwh"] == e["kwh"]
        metrics = client.get_run(data["mlflow_run_id"]).data.metrics
        assert metrics["energy.kwh"] == pytest.approx(e["kwh"]) and metrics["energy.cost_usd"] == pytest.approx(e["cost_usd"])
    for key in ("kwh", "co2e_kg", "cost_usd"):
        assert s["energy"]["total"][key] == pytest.approx(sum(d["energy"][key] for d in stages.values()))
    parent = client.get_run(s["mlflow"]["run_id"]).data.metrics
    assert parent["energy.kwh"] == pytest.approx(s["energy"]["total"]["kwh"])
    events = read_events(s["lineage_log"])
    facets = {e["job"]["name"].rsplit(".", 1)[-1]: e["run"]["facets"]["crucible_energy"] for e in events
              if e["eventType"] == "COMPLETE" and "crucible_energy" in e["run"]["facets"]}
    assert len(facets) == 3 and sorted(f["energy_kwh"] for f in facets.values()) == sorted(
        d["energy"]["kwh"] for d in stages.values())
    assert not [err for e in events for err in event_errors(e)]  # the facet validates against its schema
    logged = [json.loads(line) for line in (Path(s["run_dir"]) / "energy.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in logged] == list(stages)


def test_cli_curate_fails_fast_on_a_bad_config_and_is_listed(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "infra.cli", "curate", str(REPO / "configs" / "tiny.yaml"),
                          "--set", "curate.dedup.substring.min_tokens=1"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "min_tokens" in bad.stderr
    helped = subprocess.run([sys.executable, "-m", "infra.cli", "curate", "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "--summary" in helped.stdout and "quality" in helped.stdout
