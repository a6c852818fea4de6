"""Event-triggered evaluation and deployment against a real Prefect server and the stack's real
worker (its service spec) with the deployments `up` registers in its work pool: checkpoint events
for two tiny real checkpoints of one run -> evaluate-checkpoint flow runs on the worker (never
overlapping) -> crucible.eval.completed -> deploy-model flow run -> a champion in the MLflow registry."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import torch

from flows.triggers import evaluate_task, retried, run_paths
from infra import stack
from lm_helpers import tiny_cfg, tokenizer_artifact, tokens_artifact
from infra.settings import StackConfig
from tasks.core.hashing import sha256_file
from tasks.core.layout import RunLayout
from tasks.core.net import free_port
from tasks.train.checkpoint import apply_retention, save_checkpoint
from tasks.train.model import GPT, GPTConfig


def test_run_paths_from_checkpoint(tmp_path):
    p = run_paths(tmp_path / "runs" / "r1" / "train" / "checkpoints" / "step-000010")
    run = (tmp_path / "runs" / "r1").resolve()
    assert p["run_dir"] == str(run) and p["config"] == str(run / "config.json")
    assert p["tokenizer"] == str(run / "tokenizer" / "tokenizer.json")
    assert p["tokens_index"] == str(run / "tokens" / "index.json")
    assert run_paths(run / "train" / "checkpoints" / "step-1")["tokenizer"] == str(run / "tokenizer" / "tokenizer.json")
    with pytest.raises(ValueError):
        run_paths(tmp_path / "somewhere" / "step-1")
    # a failed evaluation is retried, with backoff, as often as the run's config says
    assert retried(evaluate_task, StackConfig()).retries == StackConfig().eval_retries >= 1
    assert retried(evaluate_task, StackConfig(eval_retries=5)).retries == 5


def test_triggered_flows_load_checkpoints_only_under_registered_run_roots(tmp_path, monkeypatch):
    """An event is a claim: the checkpoint it names must lie under a run root `crucible run`
    registered with the stack, else the flow refuses it before reading anything."""
    from flows.triggers import trusted_run_paths
    from tasks.deploy.triggered import ForgedClaim

    stack_cfg = StackConfig(state_dir=str(tmp_path / "state"))
    monkeypatch.setenv(stack.STATE_DIR_ENV, str(tmp_path / "state"))
    ours = tmp_path / "runs" / "r1" / "train" / "checkpoints" / "step-000010"
    elsewhere = tmp_path / "planted" / "r1" / "train" / "checkpoints" / "step-000010"
    with pytest.raises(ForgedClaim, match="none"):
        trusted_run_paths(ours)
    stack.register_run_root(stack_cfg, tmp_path / "runs")
    stack.register_run_root(stack_cfg, tmp_path / "runs")  # once
    assert stack.run_roots(stack_cfg) == [(tmp_path / "runs").resolve()]
    assert trusted_run_paths(ours)["run_dir"] == str((tmp_path / "runs" / "r1").resolve())
    with pytest.raises(ForgedClaim, match="not under a run root"):
        trusted_run_paths(elsewhere)
    # an object-store run: the event names the checkpoint's object; only a registered store's are taken
    from tasks.core.storage import RunStore

    store = RunStore("s3://runs/crucible", {"key": "${AWS_ACCESS_KEY_ID}"}, str(tmp_path / "cache"))
    claim = "s3://runs/crucible/r1/train/checkpoints/step-000010"
    with pytest.raises(ForgedClaim, match="not in a run store of this stack"):
        trusted_run_paths(claim)
    stack.register_run_store(stack_cfg, store)
    stack.register_run_root(stack_cfg, store.local_root)
    assert stack.run_stores(stack_cfg) == [{"root": store.root, "options": store.options, "cache_dir": store.cache_dir}]
    for forged in ("s3://other/crucible/r1/train/checkpoints/step-000010",
                   "s3://runs/crucible/../../x/r1/train/checkpoints/step-000010"):
        with pytest.raises(ForgedClaim):
            trusted_run_paths(forged)


def test_a_run_root_or_store_planted_in_the_state_dir_is_not_trusted(tmp_path, monkeypatch):
    """run-roots.json and run-stores.json decide where an event's checkpoint may come from: a root or
    store written there by anyone but the stack (unsigned, or with a signature of another key) is
    refused, and the genuine registrations still count."""
    from flows.triggers import trusted_run_paths
    from tasks.core.signing import SIGNING_KEY_FILE_ENV, dumps_signed
    from tasks.deploy.triggered import ForgedClaim

    state = tmp_path / "state"
    stack_cfg = StackConfig(state_dir=str(state))
    monkeypatch.setenv(stack.STATE_DIR_ENV, str(state))
    planted = tmp_path / "planted" / "r1" / "train" / "checkpoints" / "step-000010"
    state.mkdir(parents=True)
    (state / stack.RUN_ROOTS_FILE).write_text(json.dumps([str(tmp_path / "planted")]))
    (state / stack.RUN_STORES_FILE).write_text(json.dumps([{"root": "s3://evil/x", "options": {}, "cache_dir": "/tmp"}]))
    assert stack.run_roots(stack_cfg) == [] and stack.run_stores(stack_cfg) == []
    with pytest.raises(ForgedClaim):
        trusted_run_paths(planted)
    # signed with another key: refused the same
    own_key = os.environ[SIGNING_KEY_FILE_ENV]
    monkeypatch.setenv(SIGNING_KEY_FILE_ENV, str(tmp_path / "other.key"))
    forged = dumps_signed({"roots": [str(tmp_path / "planted")]}, stack.RUN_ROOTS_PURPOSE)
    monkeypatch.setenv(SIGNING_KEY_FILE_ENV, own_key)
    (state / stack.RUN_ROOTS_FILE).write_text(forged)
    assert stack.run_roots(stack_cfg) == []
    # the stack's own registration replaces what it refused
    stack.register_run_root(stack_cfg, tmp_path / "runs")
    assert stack.run_roots(stack_cfg) == [(tmp_path / "runs").resolve()]


def test_a_store_working_copy_is_the_same_folder_from_any_working_directory(tmp_path, monkeypatch):
    """`storage.cache_dir` given relative or with ~ is fixed when the store is opened: the stack's
    worker, started elsewhere, maps the event's object into the same working copy as the run."""
    from tasks.core.storage import RunStore

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    relative = RunStore("s3://runs/crucible", {}, "cache")
    home = RunStore("s3://runs/crucible", {}, "~/cache")
    monkeypatch.chdir("/")
    registered = RunStore(relative.root, relative.options, relative.cache_dir)  # as the worker opens it
    assert registered.local_root == tmp_path / "cache" / "s3" / "runs" / "crucible"
    assert home.local_root == tmp_path / "home" / "cache" / "s3" / "runs" / "crucible"


def test_a_worker_reads_a_store_runs_checkpoint_where_it_lives(tmp_path, monkeypatch):
    """A genuine claim: an event naming a checkpoint object of a store `crucible run` registered. The
    triggered flow on another machine reads the checkpoint, its run's tokenizer and token index on
    the store (their URIs): nothing of the run is copied into its working copy. A key that climbs out
    of the store is refused."""
    from flows.triggers import trusted_run_paths
    from s3_helpers import moto_s3
    from tasks.core import storage
    from tasks.deploy.triggered import ForgedClaim

    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        monkeypatch.setattr(storage, "_STORES", {})
        run = "crucible/r1"
        objects = {"config.json": "{}", "tokenizer/tokenizer.json": "{}", "tokens/index.json": "{}",
                   "tokens/train.bin": "tttt", "tokens/val.bin": "vv", "train/checkpoints/checkpoints.json": "{}",
                   "train/checkpoints/step-000010/crucible_checkpoint.json": "{}"}
        for key, body in objects.items():
            s3.client.put_object(Bucket="runs", Key=f"{run}/{key}", Body=body.encode())
        # what `crucible run` registers on the stack; the worker opens the store from that record
        store = storage.RunStore("s3://runs/crucible", s3.options, str(tmp_path / "worker-cache"))
        stack_cfg = StackConfig(state_dir=str(tmp_path / "state"))
        monkeypatch.setenv(stack.STATE_DIR_ENV, str(tmp_path / "state"))
        stack.register_run_store(stack_cfg, store)
        stack.register_run_root(stack_cfg, store.local_root)
        paths = trusted_run_paths("s3://runs/crucible/r1/train/checkpoints/step-000010")
        assert paths == {"run_dir": str(store.local_root / "r1"),
                         "checkpoint": "s3://runs/crucible/r1/train/checkpoints/step-000010",
                         "config": str(store.local_root / "r1" / "config.json"),
                         "tokenizer": "s3://runs/crucible/r1/tokenizer/tokenizer.json",
                         "tokens_index": "s3://runs/crucible/r1/tokens/index.json"}
        assert not [p for p in tmp_path.joinpath("worker-cache").rglob("*") if p.is_file()]
        with pytest.raises(ForgedClaim):
            trusted_run_paths("s3://runs/crucible/../elsewhere/r1/train/checkpoints/step-000010")


def test_the_pretrain_flow_reads_triggered_records_and_checkpoints_of_a_store_run_there(tmp_path, monkeypatch):
    """A store run's triggered records are written and pushed by a flow on another machine (another
    working copy); the pretrain flow reads them, and hashes the checkpoint they name, from the store:
    nothing is synced into its own working copy, and a checkpoint changed on the store since its
    evaluation is refused."""
    from s3_helpers import moto_s3
    from tasks.core import storage
    from tasks.core.fs import tree_sha256
    from tasks.deploy.triggered import passing_triggered_checkpoints, triggered_evaluation, write_gate
    from tasks.evaluate.compare import checkpoint_rows
    from tasks.evaluate.evaluate import write_report

    monkeypatch.setattr(storage, "_STORES", {})
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        driver = storage.open_store("s3://runs/elsewhere", s3.options, str(tmp_path / "driver"))
        worker = storage.RunStore("s3://runs/elsewhere", s3.options, str(tmp_path / "worker"))
        ckpt_key = "elsewhere/r1/train/checkpoints/step-000004"
        for name, body in {"crucible_checkpoint.json": b"{}", "shard-00001.safetensors": b"w" * 100}.items():
            s3.client.put_object(Bucket="runs", Key=f"{ckpt_key}/{name}", Body=body)  # DCP writes the store only
        layout = RunLayout(driver.local_root / "r1")
        ckpt = layout.checkpoints_dir / "step-000004"
        report = {"step": 4, "val_loss": 5.0, "checkpoint": str(ckpt),
                  "checkpoint_sha256": tree_sha256(f"s3://runs/{ckpt_key}", s3.options),
                  "report_path": str(RunLayout(worker.local_root / "r1").triggered_eval_report(ckpt))}
        write_report(report)
        write_gate(report, {"passed": True, "reason": "first"})
        worker.push(report["report_path"])

        got = triggered_evaluation(layout, ckpt)
        assert got is not None and got["gate"]["reason"] == "first"
        assert passing_triggered_checkpoints(layout) == [str(ckpt)]
        assert not [p for p in driver.local_root.rglob("*") if p.is_file() and "crucible-store" not in p.name]
        # the checkpoint table: the store's reports beside this process's own, not yet pushed
        write_report({"step": 2, "val_loss": 6.0, "checkpoint": str(ckpt.with_name("step-000002")),
                      "report_path": str(layout.eval_report("step-000002"))})
        rows = checkpoint_rows(layout.run_dir)
        assert [(r["step"], r["evaluated_by"], r["gate"]) for r in rows] == [
            (2, "pretrain flow", None), (4, "trigger", "passed: first")]
        s3.client.put_object(Bucket="runs", Key=f"{ckpt_key}/shard-00001.safetensors", Body=b"x" * 100)
        assert triggered_evaluation(layout, ckpt) is None  # its tree hash on the store is not the evaluated one
        # the guard: after all these reads the driver's working copy holds its own report only, no
        # checkpoint file and no copy of the store's report
        assert sorted(p.relative_to(driver.local_root).as_posix() for p in driver.local_root.rglob("*")
                      if p.is_file() and "crucible-store" not in p.name) == ["r1/evaluate/step-000002.json"]


def test_a_genuine_report_of_another_run_copied_into_this_run_is_refused(tmp_path, monkeypatch):
    """A signature says the stack wrote a report, not where it belongs: r2's passing report copied by a
    writer of the store into r1's evaluate/triggered/ (same step, same file name) must not make r1's
    deploy stage wait on a deploy-model run for r2's checkpoint, nor show in r1's checkpoint table."""
    from s3_helpers import moto_s3
    from tasks.core import storage
    from tasks.deploy.triggered import passing_triggered_checkpoints, write_gate
    from tasks.evaluate.compare import checkpoint_rows
    from tasks.evaluate.evaluate import write_report

    monkeypatch.setattr(storage, "_STORES", {})
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "driver"))
        r1, r2 = RunLayout(store.local_root / "r1"), RunLayout(store.local_root / "r2")
        theirs = store.uri("r2/train/checkpoints/step-000004")
        report = {"step": 4, "val_loss": 1.0, "checkpoint": theirs, "checkpoint_sha256": "0" * 64,
                  "report_path": str(r2.triggered_eval_report(theirs))}
        write_report(report)
        write_gate(report, {"passed": True, "reason": "better"})
        store.push(report["report_path"])
        s3.client.put_object(Bucket="runs", Key="crucible/r1/evaluate/triggered/step-000004.json",
                             Body=Path(report["report_path"]).read_bytes())
        assert passing_triggered_checkpoints(r2) == [theirs]  # where it belongs it is taken
        assert passing_triggered_checkpoints(r1) is None  # refused: r1's deploy stage deploys itself
        assert checkpoint_rows(r1.run_dir) == [] and [r["step"] for r in checkpoint_rows(r2.run_dir)] == [4]


def test_checkpoint_table_and_triggered_handover_files(tmp_path):
    """The run's checkpoint table (newest report per step, triggered or direct) and the pretrain
    flow's take of a triggered result once its run completed: a report without its gate verdict is not
    taken, nor a missing one (-> the stage evaluates itself). Reports are signed (tests/test_signed_records.py)."""
    from tasks.deploy.triggered import triggered_evaluation, write_gate
    from tasks.evaluate.compare import checkpoint_rows, table_key
    from tasks.evaluate.evaluate import write_report

    run_dir = tmp_path / "run"
    ckpt = run_dir / "train" / "checkpoints" / "step-000010"
    direct = {"step": 10, "val_loss": 6.0, "perplexity": 403.4, "checkpoint": str(ckpt),
              "task_metrics": {"lambada_acc": 0.1}, "report_path": str(run_dir / "evaluate" / "step-000010.json")}
    write_report(direct)
    path = RunLayout(run_dir).triggered_eval_report(ckpt)
    trig = {**direct, "step": 20, "val_loss": 5.0, "task_metrics": {"hellaswag_acc": 0.3},
            "checkpoint": str(ckpt.with_name("step-000020")), "report_path": str(path.with_name("step-000020.json"))}
    write_report(trig)
    (run_dir / "evaluate" / "notes.json").write_text("[1, 2]")  # not a report: ignored
    rows = checkpoint_rows(run_dir)
    assert [r["step"] for r in rows] == [10, 20] and [r["best"] for r in rows] == [False, True]
    assert set(rows[0]) == set(rows[1]) >= {"val_loss", "perplexity", "lambada_acc", "hellaswag_acc", "gate"}
    assert rows[0]["lambada_acc"] == 0.1 and rows[0]["hellaswag_acc"] is None and rows[1]["gate"] is None
    assert [r["evaluated_by"] for r in rows] == ["pretrain flow", "trigger"]
    assert table_key("Tiny-2026_01 x") == "eval-checkpoints-tiny-2026-01-x"

    assert triggered_evaluation(RunLayout(run_dir), ckpt) is None  # nothing there yet
    report = {**direct, "report_path": str(path)}
    write_report(report)
    assert triggered_evaluation(RunLayout(run_dir), ckpt) is None  # not gated yet: still being written
    write_gate(report, {"passed": False, "reason": "val_loss too high"})
    got = triggered_evaluation(RunLayout(run_dir), ckpt)
    assert got["gate"] == {"passed": False, "reason": "val_loss too high"}
    assert checkpoint_rows(run_dir)[0]["gate"] == "failed: val_loss too high"

    # the deploy stage deploys a best checkpoint itself when the pretrain flow evaluated it (its triggered
    # evaluation failed or was taken over) and it passed its gate: no deploy-model run was triggered for it
    from flows.triggered_runs import deploys_itself
    from tasks.deploy.triggered import EVALUATED_BY

    passed = {"checkpoint": str(ckpt), "gate": {"passed": True, "reason": "no champion yet"}}
    assert deploys_itself(passed, []) and deploys_itself(passed, [str(ckpt.with_name("step-000020"))])
    assert not deploys_itself({**passed, "evaluated_by": EVALUATED_BY}, [str(ckpt)])  # its deploy-model run's
    assert not deploys_itself({**passed, "gate": {"passed": False, "reason": "worse"}}, [])
    assert not deploys_itself(passed, [str(ckpt)])  # its triggered evaluation passed too: deploy-model deployed it


@pytest.mark.e2e
def test_the_pretrain_flow_waits_on_triggered_flow_runs_through_prefect(tmp_path, monkeypatch):
    """The pretrain flow's wait (flows/triggered_runs.py), against a real temporary Prefect server:
    a checkpoint's flow run is found by deployment, `checkpoint` parameter and a start after the
    pretrain flow run's (an earlier attempt's is not taken), and waited on until it is final (a run
    completing during the wait is taken); FAILED gives nothing to take; one still running at the
    timeout is cancelled (never forced: a COMPLETED run stays so) and read until it is CANCELLED, so
    that the stage that then does the work never races it; a run started after the pretrain flow took
    over (its takeover marker) does nothing."""
    import asyncio
    import contextvars
    import logging
    import threading
    from datetime import timedelta

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled, Completed, Failed, Running
    from prefect.testing.utilities import prefect_test_harness

    from flows import triggered_runs
    from flows.run_context import RunContext
    from flows.triggered_runs import collect_deployment, completed_flow_run, taken_over
    from flows.triggers import evaluate_checkpoint_flow
    from tasks.core.constants import DEPLOY_FLOW, EVAL_FLOW

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.setattr(triggered_runs, "POLL", 0.5)
    monkeypatch.setattr(triggered_runs, "CANCEL_GRACE", 60.0)
    names = ("stale", "done", "late", "failed", "stuck", "hung")
    ckpt = {name: tmp_path / "runs" / "r" / "train" / "checkpoints" / name for name in names}
    with prefect_test_harness(server_startup_timeout=180), get_client(sync_client=True) as client:
        deployment = client.create_deployment(client.create_flow_from_name(EVAL_FLOW), EVAL_FLOW)
        pretrain = client.create_flow_run_from_deployment(
            client.create_deployment(client.create_flow_from_name("pretrain"), "pretrain"), parameters={})
        client.set_flow_run_state(pretrain.id, Running(), force=True)
        runs = {}
        for name in names:  # "stale": an earlier attempt's, before this pretrain flow run started
            runs[name] = client.create_flow_run_from_deployment(deployment, parameters={"checkpoint": str(ckpt[name])})
            if name == "stale":
                since = client.read_flow_run(runs[name].id).expected_start_time + timedelta(milliseconds=1)
                time.sleep(0.01)
        for name, final in (("stale", Completed()), ("done", Completed()), ("late", None), ("failed", Failed()),
                            ("stuck", None), ("hung", None)):
            client.set_flow_run_state(runs[name].id, Running(), force=True)
            if final:
                client.set_flow_run_state(runs[name].id, final, force=True)
        owner = str(pretrain.id)
        assert completed_flow_run(EVAL_FLOW, ckpt["done"], 30, since, owner).id == runs["done"].id
        assert completed_flow_run(EVAL_FLOW, ckpt["stale"], 3, since, owner) is None  # not this attempt's
        assert completed_flow_run(EVAL_FLOW, ckpt["stale"], 3).id == runs["stale"].id  # what `since` filters out
        def complete_late():
            with get_client(sync_client=True) as other:
                other.set_flow_run_state(runs["late"].id, Completed(), force=True)

        # completes while the flow waits on its state (the thread gets the harness's settings)
        finish = threading.Timer(3, contextvars.copy_context().run, args=(complete_late,))
        finish.start()
        try:
            assert completed_flow_run(EVAL_FLOW, ckpt["late"], 120, since, owner).id == runs["late"].id
        finally:
            finish.join()
        assert completed_flow_run(EVAL_FLOW, ckpt["failed"], 30, since, owner) is None

        # no run appears: the takeover marker holds off the one the automation creates later
        never = tmp_path / "runs" / "r" / "train" / "checkpoints" / "never-saved"
        assert completed_flow_run(EVAL_FLOW, never, 3, since, owner) is None
        assert owner in taken_over(EVAL_FLOW, str(never))
        assert evaluate_checkpoint_flow(checkpoint=str(never), return_state=True).is_cancelled()

        # cancelling is not forced: a run that has just COMPLETED is left so, and taken
        async def cancel(run_id):
            async with get_client() as c:
                return await triggered_runs._cancel(c, await c.read_flow_run(run_id), EVAL_FLOW, "test")
        assert asyncio.run(cancel(runs["done"].id)).state.is_completed()
        assert client.read_flow_run(runs["done"].id).state.type == StateType.COMPLETED

        # a run still going at the timeout is cancelled and read until it is CANCELLED (as its worker
        # ends it once it sees CANCELLING), before the stage does the work
        def worker_cancels():
            with get_client(sync_client=True) as other:
                deadline = time.monotonic() + 60
                while other.read_flow_run(runs["stuck"].id).state.type != StateType.CANCELLING:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
                time.sleep(2)
                other.set_flow_run_state(runs["stuck"].id, Cancelled(), force=True)

        worker = threading.Thread(target=contextvars.copy_context().run, args=(worker_cancels,))
        worker.start()
        try:
            assert completed_flow_run(EVAL_FLOW, ckpt["stuck"], 3, since, owner) is None
            assert client.read_flow_run(runs["stuck"].id).state.type == StateType.CANCELLED  # waited for it
        finally:
            worker.join()
        # one that is not CANCELLED within the grace period: logged as an error
        monkeypatch.setattr(triggered_runs, "CANCEL_GRACE", 2.0)
        caplog = []
        handler = logging.Handler()
        handler.emit = caplog.append
        triggered_runs.log.addHandler(handler)
        try:
            assert completed_flow_run(EVAL_FLOW, ckpt["hung"], 1, since, owner) is None
        finally:
            triggered_runs.log.removeHandler(handler)
        assert any(r.levelno == logging.ERROR and "still CANCELLING" in r.getMessage() for r in caplog)
        assert client.read_flow_run(runs["failed"].id).state.type == StateType.FAILED  # a final run is left alone

        # the deploy stage deploys a best checkpoint the pretrain flow evaluated itself (passing) and
        # holds off a deploy-model run of it
        from lm_helpers import tiny_cfg

        run_dir = tmp_path / "runs" / "r"
        run = RunContext(run_name="r", run_dir=str(run_dir), lineage_log=str(run_dir / "lineage.jsonl"),
                         tracking_uri="", experiment="r", mlflow_parent_run_id="", root_run_id=owner, triggered=True)
        best = {"checkpoint": str(ckpt["done"]), "gate": {"passed": True, "reason": "no champion yet"}}
        assert collect_deployment(tiny_cfg(stack={"triggered_timeout": 3}), run, best, since) is None
        assert owner in taken_over(DEPLOY_FLOW, str(ckpt["done"]))
        client.set_flow_run_state(pretrain.id, Completed(), force=True)
        assert taken_over(DEPLOY_FLOW, str(ckpt["done"])) is None  # a finished flow run's marker holds nothing


def _make_run(base: Path, root: Path, store: str) -> tuple[Path, list[Path]]:
    tok, tokens = tokenizer_artifact(base), tokens_artifact(base)
    run_dir = root / "runs" / "trig-run"
    (run_dir / "tokenizer").mkdir(parents=True)
    shutil.copy(tok["path"], run_dir / "tokenizer" / "tokenizer.json")
    shutil.copytree(Path(tokens["index_path"]).parent, run_dir / "tokens")
    off = {"enabled": False}
    cfg = tiny_cfg(evaluate={"wikitext": off, "lambada": off, "hellaswag": off, "calibration": off,
                             "sample_tokens": 4},
                   deploy={"max_val_loss": 100.0, "serve": False, "model_name": "trig-model"},
                   stack={"eval_retry_backoff": 1, "triggered_timeout": 120})
    cfg = cfg.model_copy(update={"run_root": str(root / "runs")})
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    index = json.loads((run_dir / "tokens" / "index.json").read_text())
    ckpts = []
    for step, seed in ((10, 0), (20, 1)):
        torch.manual_seed(seed)
        mcfg = GPTConfig(vocab_size=index["vocab_size"], **cfg.model.model_dump())
        model = GPT(mcfg)
        meta = {"model": mcfg.to_dict(), "eos_id": index["eos_id"], "run_name": "trig-run",
                "tokenizer_sha256": sha256_file(run_dir / "tokenizer" / "tokenizer.json"), "step": step}
        ckpts.append(save_checkpoint(model, torch.optim.AdamW(model.parameters()), step, run_dir / "train", meta))
        apply_retention(run_dir / "train", ckpts[-1], None)
    return run_dir, ckpts


def _event(name: str, resource: dict, payload: dict) -> dict:
    return {"id": str(uuid.uuid4()), "occurred": datetime.now(timezone.utc).isoformat(), "event": name,
            "resource": resource, "payload": payload, "related": []}


def _wait(what: str, fn, timeout: float, every: float = 1.0):
    """Poll fn until it returns something truthy. A poll that times out, loses its connection or
    gets a 5xx answer is retried: on a 2-core machine the evaluations it waits for can hold up the
    server for a while, and a watcher should outlast that, as Prefect's own client does. Only the
    overall deadline fails."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            got = fn()
        except (httpx.TransportError, httpx.HTTPStatusError) as e:
            if isinstance(e, httpx.HTTPStatusError) and e.response.status_code < 500:
                raise
            last_error, got = e, None
            print(f"\npolling for {what}: {type(e).__name__} after {time.monotonic() - started:.1f}s; retrying")
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}" + (f" (last poll error: {last_error!r})" if last_error else ""))


@pytest.mark.e2e
def test_checkpoint_event_evaluates_then_deploys(tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.delenv(stack.STATE_DIR_ENV, raising=False)
    base = tmp_path_factory.getbasetemp() / "lm"
    store = f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"  # nothing may land in the working directory
    run_dir, ckpts = _make_run(base, tmp_path, store)
    from mlflow import MlflowClient

    # the SQLite store's tables, made once here: the two evaluations start together on the worker,
    # and two processes creating a fresh store at once collide (the stack's MLflow server makes its own)
    MlflowClient(tracking_uri=store).search_experiments()
    stack_cfg = StackConfig(state_dir=str(tmp_path / "state"), prefect_port=free_port(),
                            mlflow_port=free_port(), worker_port=free_port(), start_timeout=150, stop_timeout=10)
    stack.register_run_root(stack_cfg, tmp_path / "runs")  # as `crucible run` does for its config
    # and as its pretrain flow does when it opens the run: the flows' config is this signed copy
    stack.register_run_config(stack_cfg, run_dir, json.loads((run_dir / "config.json").read_text()))
    spec = stack.prefect_worker_spec(stack_cfg)  # its flow runs inherit its environment
    spec.env.update({"MLFLOW_TRACKING_URI": store})
    api = stack.prefect_api_url(stack_cfg)
    t0 = time.monotonic()
    try:
        with stack.stack_lock(stack_cfg):
            stack.start_services(stack_cfg, [stack.prefect_spec(stack_cfg)])
            registered = stack.register_deployments(stack_cfg)
            stack.start_services(stack_cfg, [spec])
        assert set(registered["registered"]) == set(stack.EVENT_DEPLOYMENTS) and registered["pool"] == "crucible"
        print(f"\nprefect + worker healthy, deployments registered after {time.monotonic() - t0:.1f}s")
        # the stack's Prefect has server auth on: clients send its auth string (here and in subprocesses)
        assert httpx.post(f"{api}/deployments/filter", json={}, timeout=60).status_code == 401
        monkeypatch.setenv("PREFECT_API_AUTH_STRING", stack.prefect_auth_env(stack_cfg)["PREFECT_API_AUTH_STRING"])
        c = httpx.Client(base_url=api, timeout=60, trust_env=False, headers=stack.prefect_headers(stack_cfg))
        deps = {}
        for name in ("evaluate-checkpoint/evaluate-checkpoint", "deploy-model/deploy-model"):
            r = c.get(f"/deployments/name/{name}")
            assert r.status_code == 200, r.text
            deps[name.split("/")[0]] = r.json()["id"]
        def enabled_automations():
            found = c.post("/automations/filter", json={}).raise_for_status().json()
            return [a for a in found if a["enabled"]] if len(found) >= 2 else None

        autos = _wait("automations", enabled_automations, 120)
        assert len(autos) >= 2
        # let the server's trigger service load the new automations: no API tells when it has;
        # its periodic reconcile runs every 5 s, so this covers two passes
        time.sleep(12)

        events = [_event("crucible.checkpoint.saved", {"prefect.resource.id": f"crucible.checkpoint.trig-run.{s}"},
                         {"path": str(p), "step": s, "run_id": None, "run_name": "trig-run"})
                  for s, p in zip((10, 20), ckpts)]
        assert c.post("/events", json=events).status_code in (200, 204)

        def runs(dep_id):
            return c.post("/flow_runs/filter", json={"flow_runs": {"deployment_id": {"any_": [dep_id]}}}
                          ).raise_for_status().json()

        def finished(dep_id, n):
            rs = runs(dep_id)
            failed = [r for r in rs if r["state_type"] in ("FAILED", "CRASHED")]
            assert not failed, (failed[0]["state"], (Path(stack_cfg.state_dir) / "logs").exists())
            return rs if len([r for r in rs if r["state_type"] == "COMPLETED"]) >= n else None

        evals = _wait("two completed evaluate-checkpoint runs", lambda: finished(deps["evaluate-checkpoint"], 2), 300, 2)
        assert sorted(r["parameters"]["checkpoint"] for r in evals) == sorted(str(p) for p in ckpts)
        assert {r["work_pool_name"] for r in evals} == {"crucible"}  # run by the stack's worker
        # one run's evaluations never overlap: the `evaluate` task runs follow each other
        trs = c.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": [r["id"] for r in evals]}},
                                                "task_runs": {"name": {"like_": "evaluate"}}}).json()
        spans = sorted((tr["start_time"], tr["end_time"]) for tr in trs if tr["state_type"] == "COMPLETED")
        assert len(spans) == 2 and spans[0][1] <= spans[1][0], spans
        limit = c.post("/v2/concurrency_limits/filter", json={}).json()
        assert any(lim["name"] == "crucible-eval-trig-run" and lim["limit"] == 1 for lim in limit)

        deploys = _wait("a completed deploy-model run", lambda: finished(deps["deploy-model"], 1), 180, 2)
        assert deploys[0]["parameters"]["checkpoint"] in [str(p) for p in ckpts]
        assert list((run_dir / "evaluate" / "triggered").glob("step-*.json"))

        client = MlflowClient(tracking_uri=store, registry_uri=store)
        mv = client.get_model_version_by_alias("trig-model", "champion")
        assert mv.tags["checkpoint"] in [str(p) for p in ckpts]
        # challenger -> verified -> champion; no challenger alias left once the deploys are done
        assert mv.tags["deployment.status"] == "champion" and mv.tags["deployment.verified"]
        assert mv.tags["data.licences"] and mv.tags["lineage.checkpoint_node"].endswith(mv.tags["checkpoint"])

        # what a pretrain flow with the stack up collects instead of evaluating/deploying again
        from infra.settings import CrucibleConfig
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        from flows.run_context import RunContext
        from flows.triggered_runs import collect_deployment, collect_evaluation, completed_flow_run
        from tasks.evaluate.compare import table_key

        monkeypatch.setenv("PREFECT_API_URL", api)
        # a loss-spike action reaches the server as a crucible.train.spike event with its details,
        # sent from a separate process as the torchrun worker sends it
        from tasks.core.constants import SPIKE_EVENT

        code = ("from flows.train_worker import PrefectEvents\nevents = PrefectEvents()\n"
                "ok = events.spike('rollback', 9, 'run-x', 'trig-run', to_checkpoint='step-000008', "
                "skipped_data=[64, 80])\nevents.drain()\nassert ok")
        proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                              env={**os.environ, "PREFECT_API_URL": api}, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        spikes = _wait("the spike event", lambda: [e for e in c.post("/events/filter", json={
            "filter": {"event": {"name": [SPIKE_EVENT]}}}).json()["events"] if e["payload"].get("run_id") == "run-x"], 30)
        assert spikes[0]["payload"] == {"action": "rollback", "step": 9, "run_id": "run-x", "run_name": "trig-run",
                                        "to_checkpoint": "step-000008", "skipped_data": [64, 80]}
        assert spikes[0]["resource"]["crucible.action"] == "rollback"
        run = RunContext(run_name="trig-run", run_dir=str(run_dir), lineage_log=str(run_dir / "lineage.jsonl"),
                         tracking_uri=store, experiment="trig", mlflow_parent_run_id="",
                         root_run_id=str(uuid.uuid4()), triggered=True)
        # this process imported Prefect before the stack was up: its client is pointed at the stack here
        stack_prefect = temporary_settings({PREFECT_API_URL: api,
                                            PREFECT_API_AUTH_STRING: os.environ["PREFECT_API_AUTH_STRING"]})
        cfg = CrucibleConfig.model_validate_json((run_dir / "config.json").read_text())
        with stack_prefect:  # the flow runs, waited on through Prefect's client, then their signed records
            assert completed_flow_run("evaluate-checkpoint", ckpts[0], 5).state.is_completed()
            reports = [collect_evaluation(cfg, run, str(p)) for p in ckpts]
            assert all(r and r["gate"]["reason"] for r in reports)
            best = min(reports, key=lambda r: r["val_loss"])
            deployed = collect_deployment(cfg, run, best)  # every passing one's deploy
        champ = client.get_model_version_by_alias("trig-model", "champion")
        assert deployed["version"] == int(champ.version) and deployed["checkpoint"] == champ.tags["checkpoint"]
        assert "challenger" not in client.get_registered_model("trig-model").aliases
        # the run's checkpoint table, updated by each triggered evaluation
        arts = c.post("/artifacts/filter", json={"artifacts": {"key": {"any_": [table_key("trig-run")]}}}).json()
        rows = json.loads(max(arts, key=lambda a: a["created"])["data"])
        assert [r["step"] for r in rows] == [10, 20] and all(r["gate"] for r in rows)
        # the pretrain flow leaves the work to the triggered flows only when the worker runs them for its
        # own Prefect and MLflow
        from flows.triggers import triggers_active

        tcfg = cfg.model_copy(update={"stack": stack_cfg})
        assert not triggers_active(tcfg)  # MLflow here is a SQLite file, not the stack's server
        monkeypatch.setenv("MLFLOW_TRACKING_URI", stack.mlflow_tracking_uri(stack_cfg))
        assert triggers_active(tcfg)
        with stack.stack_lock(stack_cfg):
            stack.stop_service(stack_cfg, stack.WORKER)
        assert not triggers_active(tcfg)  # no worker: the flow evaluates itself
        with stack.stack_lock(stack_cfg):
            stack.start_services(stack_cfg, [spec])
        assert triggers_active(tcfg)
        # stack.triggers off: `up` removes the deployments and their automations, the worker stays
        off = stack.register_deployments(stack_cfg.model_copy(update={"triggers": False}))
        assert sorted(off["removed"]) == sorted(stack.EVENT_DEPLOYMENTS) and not off["registered"]
        assert not triggers_active(tcfg) and not c.post("/automations/filter", json={}).json()
        monkeypatch.delenv("PREFECT_API_URL")
        assert not triggers_active(tcfg)
        print(f"checkpoint events -> evaluations -> deployment in {time.monotonic() - t0:.1f}s")
        assert not list(Path.cwd().glob("mlflow.db")) and not list(Path.cwd().glob("mlruns"))
    finally:
        with stack.stack_lock(stack_cfg):
            for name in (stack.WORKER, stack.PREFECT):
                stack.stop_service(stack_cfg, name)


@pytest.mark.e2e
def test_without_triggers_the_pretrain_subflows_evaluate_and_deploy_directly(tmp_path, tmp_path_factory,
                                                                             monkeypatch):
    """No stack worker (plain `python -m flows.pretrain`): the pretrain flow's evaluate and
    deploy subflows do the work themselves, with the gate verdict and the checkpoint table too."""
    from mlflow import MlflowClient
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from flows.pretrain import deploy, evaluate
    from flows.triggers import triggers_active
    from infra.settings import CrucibleConfig
    from tasks.evaluate.compare import table_key
    from flows.run_context import RunContext
    from tasks.tracking import Tracker

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    store = f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    run_dir, ckpts = _make_run(tmp_path_factory.getbasetemp() / "lm", tmp_path, store)
    cfg = CrucibleConfig.model_validate_json((run_dir / "config.json").read_text())
    MlflowClient(tracking_uri=store).create_experiment(cfg.name, artifact_location=(tmp_path / "art").as_uri())
    tracker = Tracker(store, cfg.name)
    parent = tracker.start_run("trig-run")
    train_run = tracker.start_run("train", parent_run_id=parent)
    tok, index = str(run_dir / "tokenizer" / "tokenizer.json"), str(run_dir / "tokens" / "index.json")
    with prefect_test_harness(server_startup_timeout=180):  # a real temporary Prefect server
        assert not triggers_active(cfg)
        ctx = RunContext(run_name="trig-run", run_dir=str(run_dir), lineage_log=str(run_dir / "lineage.jsonl"),
                         tracking_uri=store, experiment=cfg.name, mlflow_parent_run_id=parent,
                         root_run_id=str(uuid.uuid4()))
        results = evaluate(cfg, ctx, [str(p) for p in ckpts], tok, index, train_run)
        deployed = deploy(cfg, ctx, results, tok, train_run).data
        evals = [e.data for e in results]
        api = PREFECT_API_URL.value().rstrip("/")
        arts = httpx.post(f"{api}/artifacts/filter", timeout=60,
                          json={"artifacts": {"key": {"any_": [table_key("trig-run")]}}}).json()
    assert [Path(e["report_path"]).parent for e in evals] == [run_dir / "evaluate"] * 2
    assert all(e["gate"]["reason"] and "evaluated_by" not in e for e in evals)
    assert not (run_dir / "evaluate" / "triggered").exists()
    assert deployed["version"] == 1 and deployed["alias"] == "champion" and "deployed_by" not in deployed
    assert sorted(m.step for m in MlflowClient(tracking_uri=store).get_metric_history(train_run, "val_loss")) == [10, 20]
    rows = json.loads(max(arts, key=lambda a: a["created"])["data"])
    assert [r["step"] for r in rows] == [10, 20] and all(r["evaluated_by"] == "pretrain flow" for r in rows)


@pytest.mark.e2e
def test_triggered_flow_runs_emit_lineage_parented_to_the_training_run(tmp_path, tmp_path_factory, monkeypatch):
    """evaluate-checkpoint and deploy-model, run against a real temporary Prefect server: each flow
    run is an OpenLineage run (run id: the Prefect flow run's) whose parent is the torchrun training
    run of the checkpoint and whose root is the pretrain run, both read from the run's lineage log;
    the evaluate task run is one under its flow run, with the checkpoint, tokenizer, val split and
    evaluation data in and the report out. A refused deploy-model claim is a FAIL."""
    from openlineage.client.event_v2 import RunState
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from flows.triggers import deploy_model_flow, evaluate_checkpoint_flow
    from infra.settings import CrucibleConfig
    from tasks.deploy.triggered import ForgedClaim
    from tasks.lineage import JobRef, LineageEmitter, dataset_for_path
    from tasks.lineage.validate import event_errors, read_events

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.setenv(stack.STATE_DIR_ENV, str(tmp_path / "state"))
    monkeypatch.delenv("CRUCIBLE_LINEAGE_URL", raising=False)
    store = f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    run_dir, ckpts = _make_run(tmp_path_factory.getbasetemp() / "lm", tmp_path, store)
    stack.register_run_root(StackConfig(state_dir=str(tmp_path / "state")), tmp_path / "runs")
    stack.register_run_config(StackConfig(state_dir=str(tmp_path / "state")), run_dir,
                              json.loads((run_dir / "config.json").read_text()))
    cfg = CrucibleConfig.model_validate_json((run_dir / "config.json").read_text())
    # the pretrain run's lineage so far: its root run and the torchrun job still training
    log = RunLayout(run_dir).lineage_log
    em = LineageEmitter(log, cfg.lineage.namespace, cfg.lineage.producer)
    root, torchrun = JobRef("pretrain", str(uuid.uuid4())), JobRef("train.torchrun_train.torchrun", str(uuid.uuid4()))
    em.emit(RunState.START, root, job_type="FLOW")
    licence = {"name": "test", "licence": "GPL-2.0", "provenance": "Debian"}
    em.emit(RunState.START, torchrun, parent=JobRef("train.torchrun_train", str(uuid.uuid4())), root=root,
            job_type="JOB", integration="TORCH", inputs=[dataset_for_path(run_dir / "tokens" / "train.bin",
                                                                          source=licence)])
    with prefect_test_harness(server_startup_timeout=180):
        state = evaluate_checkpoint_flow(str(ckpts[0]), run_name="trig-run", return_state=True)
        assert state.is_completed(), state.message
        with pytest.raises(ForgedClaim):  # the event names a report the pipeline did not write
            deploy_model_flow(str(ckpts[0]), str(tmp_path / "planted.json"), run_name="trig-run")
        api = PREFECT_API_URL.value().rstrip("/")
        flows = [f["id"] for f in httpx.post(f"{api}/flow_runs/filter", json={}, timeout=60).json()]
        tasks = httpx.post(f"{api}/task_runs/filter", json={}, timeout=60).json()
    events = read_events(log)[2:]
    assert all(event_errors(e) == [] for e in events), [event_errors(e)[:2] for e in events]
    by_run: dict = {}
    for e in events:
        by_run.setdefault(e["run"]["runId"], []).append(e)
    eval_flow = str(state.state_details.flow_run_id)
    (deploy_flow,) = set(flows) - {eval_flow}
    (evaluate,) = [t["id"] for t in tasks if t["flow_run_id"] == eval_flow]
    assert set(by_run) == {eval_flow, deploy_flow, evaluate}  # one lineage run per Prefect run, same id
    for run_id, types in ((eval_flow, ["START", "COMPLETE"]), (evaluate, ["START", "COMPLETE"]),
                          (deploy_flow, ["START", "FAIL"])):
        assert [e["eventType"] for e in by_run[run_id]] == types
    flow_events = by_run[eval_flow] + by_run[deploy_flow]
    assert {e["job"]["name"] for e in flow_events} == {"evaluate-checkpoint", "deploy-model"}
    for e in flow_events:  # spawned by the training run's checkpoint event, under the pretrain run
        parent = e["run"]["facets"]["parent"]
        assert (parent["job"]["name"], parent["run"]["runId"]) == (torchrun.name, torchrun.run_id)
        assert (parent["root"]["job"]["name"], parent["root"]["run"]["runId"]) == ("pretrain", root.run_id)
        assert e["job"]["facets"]["jobType"]["jobType"] == "FLOW" and e["job"]["facets"]["documentation"]
    task_done = by_run[evaluate][-1]
    assert task_done["job"]["name"] == "evaluate-checkpoint.evaluate"
    assert task_done["run"]["facets"]["parent"]["run"]["runId"] == eval_flow
    assert task_done["run"]["facets"]["parent"]["root"]["run"]["runId"] == root.run_id
    assert task_done["run"]["facets"]["crucible_links"]["prefect_task_run_id"] == evaluate
    # the evaluation's energy: its run facet and the run's energy.jsonl, which the run summary totals;
    # then the gate's (scoring champion and challenger, part of the pipeline's evaluate stage too), on
    # the flow's run (the refused deploy did no work and recorded none)
    from tasks.core.energy import read_log

    measured, gate = read_log(RunLayout(run_dir).energy_log)
    assert measured["stage"] == gate["stage"] == "evaluate" and measured["kwh"] > 0 and gate["kwh"] > 0
    assert task_done["run"]["facets"]["crucible_energy"]["energy_kwh"] == measured["kwh"]
    assert by_run[eval_flow][-1]["run"]["facets"]["crucible_energy"]["energy_kwh"] == gate["kwh"]
    inputs = {i["name"]: i for i in task_done["inputs"]}
    assert {str(ckpts[0]), str(run_dir / "tokenizer" / "tokenizer.json"), str(run_dir / "tokens" / "val.bin")} <= set(inputs)
    # the checkpoint carries the licences of what its training run read (its COMPLETE is yet to come)
    assert inputs[str(ckpts[0])]["facets"]["crucible_source"]["licences"] == ["GPL-2.0"]
    report = str(RunLayout(run_dir).triggered_eval_report(ckpts[0]))
    assert [o["name"] for o in task_done["outputs"]] == [report]
    assert task_done["outputs"][0]["facets"]["crucible_source"]["licences"] == ["GPL-2.0"]
    gated = by_run[eval_flow][-1]  # the flow adds the gate's verdict: the report's final version
    assert [o["name"] for o in gated["outputs"]] == [report]
    assert gated["outputs"][0]["facets"]["version"]["datasetVersion"] == sha256_file(report)
    refused = by_run[deploy_flow][-1]
    assert "does not match the pipeline's records" in refused["run"]["facets"]["errorMessage"]["message"]
    assert {str(ckpts[0]), report} <= {i["name"] for i in refused["inputs"]} and refused["outputs"] == []
