"""Energy, CO2e and cost (tasks/core/energy.py): the process tree's CPU time (children it waited for,
children still running, grandchildren), TDP x utilisation, RAPL counters with a wrap-around,
nvidia-smi board power (a stand-in nvidia-smi on PATH), the run totals, the model card and the
planner's estimate with the same constants. The pipeline-level check (every stage > 0, summed to
the run's total) is tests/test_curation_flow.py's test_every_stage_records_energy_that_sums_to_the_run_total."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lm_helpers import tiny_cfg
from tasks.core import energy as E

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def _cfg(**energy):
    cfg = tiny_cfg()
    return cfg.model_copy(update={"energy": cfg.energy.model_copy(update=energy)})


def test_process_tree_counts_children_grandchildren_and_running_ones(tmp_path):
    cfg = _cfg(cpu_tdp_w=100.0, cpu_tdp_threads=4, sample_interval_s=0.1)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    log = tmp_path / "energy.jsonl"
    with E.measure_energy(cfg, log, "stage-x") as meter:
        # a child that burns 0.3 s itself and waits for a grandchild burning 0.3 s (reaped: os.times)
        subprocess.run([sys.executable, "-c", BURN.format(s=0.3) +
                        f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {BURN.format(s=0.3)!r}])"],
                       check=True)
        # a child still running when the block ends (sampled from /proc)
        running = subprocess.Popen([sys.executable, "-c", BURN.format(s=30)])
        time.sleep(0.1)
        while E._stat(running.pid) and E._stat(running.pid)[1] < 0.4:
            time.sleep(0.05)
    running.kill()
    running.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    children = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    r = meter.record
    assert children >= 1.0  # what the kernel says the three processes used
    # everything but the running child's last interval (0.1 s) is counted, and no more than they used
    assert children - 0.3 <= r["cpu_core_seconds"] <= children + 0.5, (r["cpu_core_seconds"], children)
    assert r["cpu_kwh"] == pytest.approx(100.0 / 4 * r["cpu_core_seconds"] / 3.6e6)
    assert r["kwh"] == r["cpu_kwh"] + r["gpu_kwh"]
    assert r["co2e_kg"] == pytest.approx(r["kwh"] * 475.0 / 1000)
    core_price = cfg.plan.curate.node_price_per_hour / cfg.plan.curate.cores_per_node
    assert r["cost_usd"] == pytest.approx(r["cpu_core_seconds"] / 3600 * core_price + r["gpu_hours"] * 3.0)
    assert "100 W over 4 hardware threads" in r["method"] and r["scope"] == "process tree"
    assert json.loads(log.read_text()) == {"stage": "stage-x", **r}


def test_tdp_default_is_codecarbons_over_the_socket_threads():
    with E.measure_energy(_cfg()) as meter:
        sum(i * i for i in range(200_000))
    r = meter.record
    threads = E.cpu_threads_per_socket()
    assert r["cpu_core_seconds"] > 0 and r["kwh"] > 0
    assert r["cpu_kwh"] == pytest.approx(E.DEFAULT_CPU_TDP_W / threads * r["cpu_core_seconds"] / 3.6e6)


def test_switched_off_records_nothing(tmp_path):
    with E.measure_energy(_cfg(enabled=False), tmp_path / "energy.jsonl") as meter:
        pass
    assert meter is None and not (tmp_path / "energy.jsonl").exists()


def test_rapl_counters_with_a_wrap_around(tmp_path, monkeypatch):
    pkg = tmp_path / "intel-rapl:0"
    (tmp_path / "intel-rapl:0:0").mkdir(parents=True)  # a sub-domain (core): not a package
    pkg.mkdir()
    (pkg / "max_energy_range_uj").write_text("1000000000\n")
    (pkg / "energy_uj").write_text("999000000\n")
    monkeypatch.setattr(E, "RAPL_ROOT", tmp_path)
    assert E.rapl_packages() == [pkg]
    rapl = E.Rapl([pkg])
    (pkg / "energy_uj").write_text("500000\n")  # wrapped: 1 J to the top + 0.5 J
    rapl.sample()
    (pkg / "energy_uj").write_text("2500000\n")
    rapl.sample()
    assert rapl.joules == pytest.approx(3.5)
    # a stage measured through RAPL: the package energy x the tree's share of the node's busy CPU
    (pkg / "energy_uj").write_text("0\n")
    with E.measure_energy(_cfg()) as meter:
        sum(i * i for i in range(300_000))
        (pkg / "energy_uj").write_text("7200000\n")  # 7.2 J
    r = meter.record
    assert r["method"].startswith("RAPL package energy (1 package(s))")
    assert 0 < r["cpu_kwh"] <= 7.2 / 3.6e6


FAKE_SMI = """#!/bin/sh
rows() { echo "0, 250.50, 700.00, 90"; echo "1, [N/A], 400.00, 50"; }
case "$*" in *--loop-ms=*) while true; do rows; sleep 0.05; done ;; *) rows ;; esac
"""


def test_gpus_from_nvidia_smi_power_draw_else_limit_x_utilisation(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with E.measure_energy(_cfg(sample_interval_s=0.1)) as meter:
        time.sleep(0.5)
    r = meter.record
    # GPU 0 reports its draw, GPU 1 only its limit: 400 W x 50 %
    assert r["gpu_kwh"] == pytest.approx((250.5 + 200.0) * r["seconds"] / 3.6e6, rel=1e-6)
    assert r["gpu_hours"] == pytest.approx(2 * r["seconds"] / 3600)
    assert "2 GPU(s): energy.gpu_tdp_w, else the board's power.limit" in r["method"]
    assert r["cost_usd"] >= r["gpu_hours"] * cfg_price()
    # energy.gpu_tdp_w stands in for a missing reading only: GPU 0's measured draw is kept
    with E.measure_energy(_cfg(sample_interval_s=0.1, gpu_tdp_w=300.0)) as meter:
        time.sleep(0.3)
    assert meter.record["gpu_kwh"] == pytest.approx((250.5 + 150.0) * meter.record["seconds"] / 3.6e6, rel=1e-6)
    # neither power.draw nor power.limit: the price table's tdp_w (one table for planner and meter)
    assert E.gpu_watts((None, None, 50.0), None, tiny_cfg().plan.gpus["h100"].tdp_w) == (350.0, False)
    assert E.parse_nvidia_smi("0, [Not Supported], [N/A], 0\n") == {0: (None, None, 0.0)}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # every GPU hidden from the stage: none measured
    with E.measure_energy(_cfg()) as meter:
        pass
    assert meter.record["gpu_kwh"] == 0 and meter.record["gpu_hours"] == 0


def _fake_smi(tmp_path, monkeypatch) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_overlapping_blocks_charge_the_boards_once(tmp_path, monkeypatch):
    """A triggered evaluate running while train measures the same boards: the boards' time goes to
    the block that claimed them first; the later block gets only the time nobody else covered."""
    _fake_smi(tmp_path, monkeypatch)
    cfg, log = _cfg(sample_interval_s=0.1), tmp_path / "run" / "energy.jsonl"
    with E.measure_energy(cfg, log, "train") as train:
        with E.measure_energy(cfg, log, "evaluate") as inner:  # wholly inside train's block
            time.sleep(0.3)
    assert inner.record["gpu_hours"] == 0 and inner.record["gpu_kwh"] == 0
    assert train.record["gpu_hours"] == pytest.approx(2 * train.record["seconds"] / 3600)
    assert "no earlier-started block of the run on this host measured them" in inner.record["method"]
    # partly overlapping: the later block is charged the part after the earlier one ended
    a = E.EnergyMeter(cfg, E.claims_path(log)).start()
    b = E.EnergyMeter(cfg, E.claims_path(log)).start()
    time.sleep(0.3)
    ra = a.stop()
    time.sleep(0.3)
    rb = b.stop()
    assert ra["gpu_hours"] == pytest.approx(2 * ra["seconds"] / 3600)
    assert 0 < rb["gpu_hours"] < 2 * rb["seconds"] / 3600
    lines = [json.loads(x) for x in E.claims_path(log).read_text().splitlines()]
    start = {x["id"]: x["start"] for x in lines if "start" in x}
    end = {x["id"]: x["end"] for x in lines if "end" in x}
    union = max(end[b.claims.id], end[a.claims.id]) - start[a.claims.id]
    assert ra["gpu_hours"] + rb["gpu_hours"] == pytest.approx(2 * union / 3600, rel=0.05)
    # a block whose process died without closing claims nothing
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with E.claims_path(log).open("a") as f:
        f.write(json.dumps({"id": "0", "host": a.claims.host, "pid": int(dead.stdout), "ticks": 1, "start": 0.0,
                            "resources": ["gpu:0", "gpu:1"]}) + "\n")
    with E.measure_energy(cfg, log, "deploy") as alone:
        time.sleep(0.2)
    assert alone.record["gpu_hours"] == pytest.approx(2 * alone.record["seconds"] / 3600)


RAY_WORKER = """import subprocess, sys
code = "open('/proc/self/comm', 'w').write('ray::burn')\\nimport time\\nt = time.time()\\nwhile time.time() - t < 30: pass\\n"
print(subprocess.Popen([sys.executable, '-c', code], start_new_session=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL).pid)
"""


def test_an_attached_clusters_ray_workers_are_charged_once(tmp_path, monkeypatch):
    """Attached to a Ray cluster, every concurrent block would count this node's `ray::` workers."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # ray_attached; nothing connects to it
    worker = int(subprocess.run([sys.executable, "-c", RAY_WORKER], capture_output=True, text=True,
                                check=True).stdout)  # its parent exited: nobody's child here
    try:
        for _ in range(1500):  # until it has named itself (at most ~30 s)
            if (E._stat(worker) or (0, 0, ""))[2] == "ray::burn":
                break
            time.sleep(0.02)
        cfg, log = _cfg(cpu_tdp_w=100.0, sample_interval_s=0.1), tmp_path / "energy.jsonl"
        with E.measure_energy(cfg, log, "train") as outer:
            with E.measure_energy(cfg, log, "evaluate") as inner:
                time.sleep(0.5)
        assert outer.record["cpu_core_seconds"] >= 0.3  # the worker's burn: counted by the first block
        assert inner.record["cpu_core_seconds"] < 0.2  # and not again by the overlapping one
        assert "Ray workers (attached cluster)" in inner.record["scope"]
    finally:
        os.kill(worker, 9)


def test_a_failing_block_is_recorded_as_failed(tmp_path):
    log = tmp_path / "energy.jsonl"
    with pytest.raises(RuntimeError, match="boom"):
        with E.measure_energy(_cfg(), log, "train"):
            sum(i * i for i in range(200_000))
            raise RuntimeError("boom")
    (rec,) = E.read_log(log)
    assert rec["stage"] == "train" and rec["status"] == "failed" and rec["cpu_core_seconds"] > 0
    assert E.run_energy([rec])["total"]["kwh"] == pytest.approx(rec["kwh"])  # the run summary counts it


def test_a_child_started_before_the_block_is_charged_only_its_time_inside(tmp_path):
    """A child that burned CPU before the block and is reaped in it: os.times adds its whole life."""
    child = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.5) + "time.sleep(0.5)\n"])
    while child.poll() is None and (E._stat(child.pid) or (0, 1.0))[1] < 0.5:
        time.sleep(0.02)
    with E.measure_energy(_cfg(sample_interval_s=0.1)) as meter:
        child.wait()
    assert meter.record["cpu_core_seconds"] < 0.3


def cfg_price() -> float:
    return tiny_cfg().plan.gpus["h100"].price_per_hour


def test_run_totals_sum_the_stages_and_a_repeated_stage():
    rec = lambda stage, kwh: {"stage": stage, **{k: kwh for k in E.TOTALS}}  # noqa: E731
    # evaluate twice: once in the pipeline, once in an event-triggered flow run
    out = E.run_energy([rec("ingest", 1.0), rec("evaluate", 0.25), rec("evaluate", 0.5)])
    assert out["stages"] == {"ingest": E.total([rec("ingest", 1.0)]), "evaluate": E.total([rec("evaluate", 0.75)])}
    assert out["total"]["kwh"] == pytest.approx(1.75) and out["total"]["cost_usd"] == pytest.approx(1.75)
    assert E.run_energy([]) is None


def test_model_card_shows_the_runs_energy(tmp_path):
    from lm_helpers import random_checkpoint, sample_tokenizer
    from tasks.core.layout import RunLayout
    from tasks.deploy.export import export_hf

    layout = RunLayout(tmp_path / "run")
    cfg = _cfg()
    with E.measure_energy(cfg, layout.energy_log, "tokenizer"):
        tok = sample_tokenizer(tmp_path / "tokenizer.json")
    with E.measure_energy(cfg, layout.energy_log, "train"):
        ckpt = random_checkpoint(layout.run_dir / "train", tok, 10, 0)
    records = E.read_log(layout.energy_log)
    assert [r["stage"] for r in records] == ["tokenizer", "train"]
    export_hf(ckpt, tok, tmp_path / "hf")
    card = (tmp_path / "hf" / "README.md").read_text()
    section = card.split("## Energy, emissions and cost", 1)[1].split("## Limitations")[0]
    total = E.total(records)
    assert f"| **total** | {total['kwh']:.3g} | {total['co2e_kg']:.3g} | {total['cost_usd']:.3g} |" in section
    assert "| tokenizer |" in section and "| train |" in section and "475 gCO2e/kWh" in section


def test_plan_estimates_energy_with_the_same_constants():
    from tasks.config import EnergyConfig, PlanConfig
    from tasks.plan import make_plan
    from tasks.plan.report import format_plan

    plan = make_plan(params=1e9, tokens=2e10, gpus=8, gpu="h100")
    assert plan["energy_kwh"] == pytest.approx(plan["gpu_hours"] * PlanConfig().gpus["h100"].tdp_w / 1000)
    assert plan["co2e_kg"] == pytest.approx(plan["energy_kwh"] * EnergyConfig().grid_gco2e_per_kwh / 1000)
    assert any("700 W board TDP" in a for a in plan["assumptions"])
    clean = make_plan(params=1e9, tokens=2e10, gpus=8, gpu="h100", energy=EnergyConfig(grid_gco2e_per_kwh=50))
    assert clean["co2e_kg"] == pytest.approx(clean["energy_kwh"] * 50 / 1000)
    assert f"{plan['energy_kwh']:,.0f} kWh" in format_plan(plan)
    # the planner reads the one GPU table (plan.gpus[...].tdp_w) the meter falls back on
    own = make_plan(params=1e9, tokens=2e10, gpus=8, gpu="h100", cfg=PlanConfig(gpus={"h100": {"tdp_w": 350}}))
    assert own["energy_kwh"] == pytest.approx(plan["energy_kwh"] / 2)
    out = subprocess.run([sys.executable, "-m", "infra.cli", "plan", "--params", "1e9", "--tokens", "2e10",
                          "--gpus", "8", "--json"], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert json.loads(out.stdout)["energy_kwh"] == pytest.approx(plan["energy_kwh"])


def test_energy_gpu_is_checked_against_the_price_table_at_load():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"energy.gpu 'h1000' is not in plan.gpus"):
        tiny_cfg(energy={"gpu": "h1000"})
    assert tiny_cfg(energy={"gpu": "A100"}).energy.gpu == "a100"
    assert tiny_cfg(energy={"gpu": "mygpu"}, plan={"gpus": {"mygpu": {"peak_bf16_flops": 1e15, "memory_gb": 80,
                                                                       "price_per_hour": 1.0}}}).energy.gpu == "mygpu"
