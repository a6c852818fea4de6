"""Signed evaluation reports, deploy records and gate records (issue 24): a run-directory writer can
rewrite them, so each is signed with the stack's key when written and verified when read; an
unsigned, rewritten or foreign-signed record is refused (logged as refused) and nothing is decided
on it: the deploy-model flow refuses the claim, the pretrain flow evaluates / deploys itself."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tasks.core.io import write_json_atomic
from tasks.core.layout import RunLayout
from tasks.deploy.triggered import (evaluation_claim_problem, passing_triggered_checkpoints, triggered_deployment,
                                    triggered_evaluation, write_gate)
from tasks.evaluate.compare import checkpoint_rows


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A run of two real (randomly initialised) checkpoints, step 10 evaluated by the
    evaluate-checkpoint flow's code and refused by the gate on the yardstick against a champion."""
    from tasks.config import PipelineConfig
    from tasks.evaluate import evaluate_checkpoint
    from test_triggers import _make_run

    root = tmp_path_factory.mktemp("signed")
    store = f"sqlite:///{root / 'mlflow.db'}"
    run_dir, (step10, _) = _make_run(tmp_path_factory.getbasetemp() / "lm", root, store)
    cfg = PipelineConfig.model_validate_json((run_dir / "config.json").read_text())
    layout = RunLayout(run_dir)
    report = evaluate_checkpoint(cfg, step10, layout.tokenizer_file, layout.tokens_index,
                                 layout.triggered_eval_report(step10))
    refused = {"passed": False, "checks": [{"check": "new data improves", "part": "new", "challenger": 2.1,
                                            "champion": 1.9, "ok": False, "rule": "champion - challenger >= 0"}],
               "reason": "yardstick refuses: new 2.1000 vs champion 1.9000"}
    yardstick = {"set": {"path": str(run_dir / "gate" / "yardstick.jsonl"), "sha256": "a" * 64, "parts": {"new": 4}},
                 "challenger": {"checkpoint": str(step10), "bits_per_byte": {"new": 2.1}},
                 "champion": {"version": 1, "content_hash": "b" * 64, "checkpoint": None,
                              "bits_per_byte": {"new": 1.9}, "scores": "reused from its registry tags"},
                 "decision": refused}
    write_gate(report, refused, yardstick)
    path = Path(report["report_path"])
    return {"layout": layout, "checkpoint": step10, "path": path, "genuine": path.read_bytes(), "store": store,
            "cfg": cfg}


def _deployment(evaluated) -> dict | None:
    """What the pretrain flow takes as deployed once the deploy-model runs of the run's passing
    checkpoints completed (flows/triggered_runs.collect_deployment, less the wait on Prefect)."""
    passing = passing_triggered_checkpoints(evaluated["layout"])
    return None if passing is None else triggered_deployment(evaluated["cfg"], evaluated["store"],
                                                             evaluated["layout"], {}, passing)


def _restore(evaluated) -> None:
    """The genuine report back in place (each test rewrites it)."""
    evaluated["path"].write_bytes(evaluated["genuine"])


def test_a_report_rewritten_to_claim_the_gate_passed_is_refused_by_the_deploy_step(evaluated, caplog):
    """The outsider edits the recorded report in place: gate and yardstick decision now say passed,
    the checkpoint hash stays the true one. deploy-model refuses the claim; the pretrain flow's
    evaluate and deploy steps do not take it (they fall back to doing the work)."""
    _restore(evaluated)
    path, ckpt, layout = evaluated["path"], evaluated["checkpoint"], evaluated["layout"]
    genuine, problem = evaluation_claim_problem(ckpt, path, None, None)
    assert genuine is None and "did not pass" in problem  # the genuine report: verified, and refused by its gate

    forged = json.loads(path.read_text())
    assert forged["gate"]["passed"] is False and forged["yardstick"]["decision"]["passed"] is False
    forged["gate"] = {**forged["gate"], "passed": True, "reason": "yardstick: new 1.2 vs champion 1.9"}
    forged["yardstick"]["decision"] = {**forged["yardstick"]["decision"], "passed": True, "checks": []}
    write_json_atomic(path, forged)
    caplog.set_level(logging.WARNING)
    report, problem = evaluation_claim_problem(ckpt, path, None, None)
    assert report is None and problem.startswith("refused: ") and "does not verify" in problem, problem
    assert any("refused:" in r.getMessage() for r in caplog.records)  # logged as refused

    assert triggered_evaluation(layout, ckpt) is None  # the evaluate step evaluates itself
    assert _deployment(evaluated) is None  # the deploy step deploys itself
    assert checkpoint_rows(layout.run_dir) == []  # nor shown in the run's checkpoint table


def test_an_unsigned_report_is_refused(evaluated, monkeypatch, tmp_path):
    """A report the pipeline never signed (planted as plain JSON, or signed with another key) is
    refused, however plausible its content."""
    _restore(evaluated)
    path, ckpt = evaluated["path"], evaluated["checkpoint"]
    body = {k: v for k, v in json.loads(path.read_text()).items() if k != "signature"}
    body["gate"] = {"passed": True, "reason": "no champion yet"}
    body.pop("yardstick")
    write_json_atomic(path, body)
    report, problem = evaluation_claim_problem(ckpt, path, None, None)
    assert report is None and "unsigned" in problem, problem
    assert triggered_evaluation(evaluated["layout"], ckpt) is None
    assert checkpoint_rows(evaluated["layout"].run_dir) == []

    from tasks.evaluate.evaluate import write_report

    with monkeypatch.context() as m:  # the outsider's own key
        m.setenv("CRUCIBLE_SIGNING_KEY_FILE", str(tmp_path / "other.key"))
        write_report({**body, "report_path": str(path)})
    report, problem = evaluation_claim_problem(ckpt, path, None, None)
    assert report is None and "does not verify" in problem, problem


def test_a_rewritten_deploy_record_is_refused(evaluated):
    """deploy/triggered/step-N.json (what the deploy-model run did with a passing checkpoint) decides
    what the pretrain flow reports as deployed: rewritten, it is refused and the flow deploys itself."""
    from tasks.core.signing import read_signed
    from tasks.deploy.triggered import write_deploy_record

    _restore(evaluated)
    path, ckpt, layout = evaluated["path"], evaluated["checkpoint"], evaluated["layout"]
    passing = json.loads(path.read_text())
    write_gate(passing, {"passed": True, "reason": "no champion yet"})  # the pipeline's own passing report
    record = layout.triggered_deploy_record(ckpt)
    write_deploy_record(record, {"passed": False, "reason": "the champion is better", "version": None,
                                 "checkpoint": str(ckpt)})
    assert read_signed(record, "deploy-record")["reason"] == "the champion is better"
    # the genuine record is taken as it is
    assert _deployment(evaluated)["reason"] \
        == "the champion is better"

    claimed = {**json.loads(record.read_text()), "passed": True, "reason": "promoted", "version": 7}
    write_json_atomic(record, claimed)
    assert _deployment(evaluated) is None


def test_a_rewritten_gate_record_is_refused(evaluated, tmp_path):
    """A gate record (the yardstick's verdict, written by against_champion and the cycle's yardstick
    stage through write_gate_record) verifies as written and not once rewritten."""
    from tasks.core.signing import SignatureError, read_signed
    from tasks.deploy.gate import read_gate_record, write_gate_record

    _restore(evaluated)
    gate = read_signed(evaluated["path"], "eval-report")["yardstick"]
    record = write_gate_record(tmp_path / "gate.json", gate)
    assert read_gate_record(record) == gate
    rewritten = json.loads(record.read_text())
    rewritten["decision"]["passed"] = True
    write_json_atomic(record, rewritten)
    with pytest.raises(SignatureError, match="does not verify"):
        read_gate_record(record)
    with pytest.raises(SignatureError):  # a signed report does not pass as a gate record either
        read_gate_record(evaluated["path"])


def test_a_yardstick_swapped_after_it_was_built_is_refused(evaluated):
    """gate/yardstick.jsonl sits in the writable run directory: swapped between its build and the
    scoring (the champion's scores are reused from tags keyed by the built hash), the challenger would
    be scored on text of the outsider's choosing. score() holds the file to the built hash."""
    from tasks.deploy.yardstick import YardstickChanged, build_yardstick, score

    layout, ckpt = evaluated["layout"], evaluated["checkpoint"]
    built = build_yardstick(evaluated["cfg"], layout.run_dir / "gate" / "yardstick.jsonl", layout.tokens_index,
                            layout.tokenizer_file, [], None)
    honest = score(ckpt, layout.tokenizer_file, built["path"], 4, yardstick_sha256=built["sha256"])
    assert set(honest) == {"new"}
    Path(built["path"]).write_text(json.dumps({"part": "new", "text": "the the the the the the"}) + "\n")
    with pytest.raises(YardstickChanged, match="refused"):
        score(ckpt, layout.tokenizer_file, built["path"], 4, yardstick_sha256=built["sha256"])


def test_a_genuine_record_copied_to_another_checkpoint_is_refused(evaluated):
    """Signed records of one kind are interchangeable unless each is held to what it is about: a
    genuine passing report (or deploy record) of another checkpoint copied into this checkpoint's
    place would become this checkpoint's evaluation (or deployment). Each is refused unless it names
    the checkpoint whose place it is in, as it is now."""
    import shutil

    from tasks.deploy.triggered import write_deploy_record

    _restore(evaluated)
    path, ckpt, layout = evaluated["path"], evaluated["checkpoint"], evaluated["layout"]
    other = ckpt.parent / "step-000020"
    passing = json.loads(path.read_text())
    write_gate(passing, {"passed": True, "reason": "no champion yet"})  # step 10's own, genuine and passing
    assert triggered_evaluation(layout, ckpt)["checkpoint"] == passing["checkpoint"]
    # step 10's report put in step 20's place
    copied = layout.triggered_eval_report(other)
    shutil.copy(path, copied)
    try:
        assert triggered_evaluation(layout, other) is None
        assert _deployment(evaluated) is None
    finally:
        copied.unlink()
    # a genuine deploy record of step 20 put in step 10's place (step 10's own record is taken)
    record = layout.triggered_deploy_record(ckpt)
    write_deploy_record(record, {"passed": False, "reason": "step 10's own", "version": None, "checkpoint": str(ckpt)})
    try:
        assert _deployment(evaluated)["reason"] == "step 10's own"
        write_deploy_record(record, {"passed": True, "reason": "promoted", "version": 3, "checkpoint": str(other)})
        assert _deployment(evaluated) is None
    finally:
        record.unlink()
