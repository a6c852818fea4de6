"""The records the event-triggered flows (flows/triggers.py) leave for a pretrain run that leaves
evaluation and deployment to them (the stack's worker runs them), read once each.

Files, in the run directory:
    evaluate/triggered/step-N.json   the evaluate-checkpoint flow's report, plus "gate": its verdict
                                     against the champion at evaluation time (written last, atomically)
    deploy/triggered/step-N.json     the deploy-model flow's deploy_if_better result

Nothing here waits: the pretrain flow waits on those flow runs through Prefect's client
(flows/triggered_runs.py) and, once a run has COMPLETED, reads its record here and hands it to the
evaluate / deploy stage as its input (StageInputs.triggered). A run that FAILED, CRASHED or did not
finish in stack.triggered_timeout seconds (it is cancelled then) leaves no record to take: the stage
does the work itself, so a broken trigger costs time, never the run's result.

Both files are signed (tasks/core/signing.py: purposes "eval-report", "deploy-record") and verified
when read: the deploy-model flow acts on a report's gate verdict and yardstick, the pretrain flow on
both, so a file that a run-directory writer planted or edited is refused (logged as refused), never
trusted: deploy-model refuses the claim, the pretrain flow evaluates / deploys directly instead.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from tasks.core.layout import RunLayout
from tasks.core.signing import SignatureError, loads_signed, write_signed
from tasks.core import fs
from tasks.core.storage import stored

log = logging.getLogger(__name__)

DEPLOY_RECORD = "deploy-record"  # the signing purpose of deploy/triggered/step-N.json
EVALUATED_BY = "evaluate-checkpoint (event-triggered)"
DEPLOYED_BY = "deploy-model (event-triggered)"
def write_gate(report: dict, decision: dict, yardstick: dict | None = None) -> dict:
    """Add the gate's verdict (and the yardstick it was decided on, which deploy-model reuses while
    the champion is the same) to an evaluation report, in memory and in its file (signed)."""
    from tasks.evaluate.evaluate import write_report

    report["gate"] = {"passed": bool(decision["passed"]), "reason": decision["reason"]}
    if yardstick:
        report["gate"] |= {"yardstick_sha256": yardstick["set"]["sha256"],
                           "champion_version": yardstick["champion"]["version"]}
        report["yardstick"] = yardstick
    write_report(report)
    return report


def write_deploy_record(path: str | Path, result: dict) -> Path:
    """The deploy-model flow's deploy_if_better result for a checkpoint, signed."""
    return write_signed(path, result, DEPLOY_RECORD)


class ForgedClaim(RuntimeError):
    """An event whose claim does not match the pipeline's records (forged, or stale)."""


def evaluation_claim_problem(checkpoint: str | Path, report_path: str | Path, run_id: str | None,
                             tracking_uri: str | None) -> tuple[dict | None, str | None]:
    """(the evaluation report, None) when a crucible.eval.completed event's claim matches the
    pipeline's own records, else (None, why). An event is a claim: its report must be the one the
    evaluate-checkpoint flow wrote for that checkpoint (in the run directory, not a path the event
    chose), name that checkpoint, carry a passing gate verdict and the tree hash of the checkpoint
    as it is now; with a training run id, the hash and val_loss logged on that MLflow run at the
    checkpoint's step must match too. An unsigned or forged report is refused (its signature is
    checked before anything it says is used)."""
    from tasks.evaluate.evaluate import REPORT_PURPOSE, eval_hash_tag

    ckpt = fs.canonical(checkpoint)  # an object-store run's: its URI
    if not RunLayout.is_run_checkpoint(ckpt):
        return None, f"{ckpt} is not a pipeline checkpoint"
    recorded = RunLayout.of_checkpoint(ckpt).triggered_eval_report(ckpt)
    if Path(report_path).resolve() != recorded.resolve():
        return None, f"the event names report {report_path}, but this checkpoint's evaluation is recorded at {recorded}"
    try:
        report = _read(recorded, REPORT_PURPOSE, "gate")
    except SignatureError as e:
        return None, f"refused: {e}"
    if report is None:
        return None, f"there is no gated evaluation report at {recorded}"
    if fs.canonical(str(report.get("checkpoint") or "")) != ckpt:
        return None, f"the report at {recorded} is of {report.get('checkpoint')}, not {ckpt}"
    if not report["gate"].get("passed"):
        return None, f"the evaluation did not pass the gate: {report['gate'].get('reason')}"
    actual = fs.tree_sha256(*stored(ckpt))  # an object-store run's checkpoint: its objects, read there
    if report.get("checkpoint_sha256") != actual:
        return None, "the checkpoint changed since it was evaluated (its tree hash is not the evaluated one)"
    if run_id:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        from tasks.deploy.registry import verified_run_tags

        try:
            client = MlflowClient(tracking_uri=tracking_uri)
            tag = eval_hash_tag(report["step"])
            logged = verified_run_tags(tracking_uri, run_id, names=(tag,))[0].get(tag)  # signed only
            losses = [m.value for m in client.get_metric_history(run_id, "val_loss") if m.step == report["step"]]
        except MlflowException as e:
            return None, f"the training run {run_id} cannot be read in MLflow: {e.error_code}"
        if logged != actual:
            return None, f"MLflow run {run_id} records no evaluation of this checkpoint at step {report['step']}"
        if not any(abs(v - float(report["val_loss"])) <= 1e-5 for v in losses):
            return None, f"the report's val_loss {report['val_loss']} is not the one logged on run {run_id}"
    return report, None


def _read(path: Path, purpose: str, key: str | None = None) -> dict | None:
    """The verified record at `path` (of an object-store run: its object, which the triggered flows
    push, wherever they ran); None if there is none, or it lacks `key` (its writer had more to add).
    SignatureError (logged as refused) if it is unsigned or forged: files are written atomically, so
    a file that does not verify was never the pipeline's."""
    try:
        text = fs.read_bytes(*stored(path))
    except OSError:
        return None
    data = loads_signed(text, purpose, what=str(path))
    return data if key is None or key in data else None


def _verified(path: Path, purpose: str, key: str, why_none: str) -> dict | None:
    """The verified record at `path` (read once), else None with the reason logged: a completed
    flow run wrote it, so a missing, incomplete or unverifiable one is never waited for."""
    try:
        data = _read(path, purpose, key)
    except SignatureError as e:  # never trusted: the stage does the work itself
        log.warning("triggered: %s; %s", e, why_none)
        return None
    if data is None:
        log.warning("triggered: no complete record at %s; %s", path, why_none)
    return data


def _not_about(record: dict, checkpoint: str | Path, what: str) -> str | None:
    """Why a verified record is not about `checkpoint` (None when it is). A signature says the stack
    wrote the record, not where it belongs: a genuine record of another checkpoint copied into this
    one's place verifies too."""
    named = str(record.get("checkpoint") or "")
    if not named or fs.canonical(named) != fs.canonical(checkpoint):
        return f"refused: {what} is about {named or 'no checkpoint'}, not {checkpoint}"
    return None


def triggered_evaluation(layout: RunLayout, checkpoint: str | Path) -> dict | None:
    """The triggered evaluation report of `checkpoint` (with its gate verdict), read once its
    evaluate-checkpoint flow run completed; None if there is none or it is refused (the evaluate
    stage then evaluates the checkpoint itself)."""
    from tasks.evaluate.evaluate import REPORT_PURPOSE

    path = layout.triggered_eval_report(checkpoint)
    report = _verified(path, REPORT_PURPOSE, "gate", "evaluating directly")
    if report is None:
        return None
    problem = _not_about(report, checkpoint, f"the report at {path}")
    ckpt = stored(checkpoint)  # an object-store run's checkpoint: its objects, hashed there
    if problem is None and fs.files(*ckpt) and report.get("checkpoint_sha256") != fs.tree_sha256(*ckpt):
        problem = f"refused: the report at {path} is of an earlier state of {checkpoint} (its tree hash differs)"
    if problem:
        log.warning("triggered: %s; evaluating directly", problem)
        return None
    report["evaluated_by"] = EVALUATED_BY
    return report


def passing_triggered_checkpoints(layout: RunLayout) -> list[str] | None:
    """The checkpoints whose triggered evaluation passed the gate (a deploy-model flow run follows
    each), from the run's verified reports; None if one is refused (the deploy stage deploys itself)."""
    from tasks.evaluate.evaluate import REPORT_PURPOSE

    passing = []
    names = fs.file_names(*stored(layout.triggered_eval_dir))  # of an object-store run: the store's listing
    for report_file in [layout.triggered_eval_dir / n for n in names if n.endswith(".json")]:
        try:
            report = _read(report_file, REPORT_PURPOSE, "gate")
        except SignatureError as e:
            log.warning("triggered: %s; deploying directly", e)
            return None
        if report is None or not report["gate"].get("passed"):
            continue
        ckpt = report.get("checkpoint")
        # by name and run: another run's genuine report copied here names that run's checkpoint
        if not ckpt or not layout.owns(ckpt) or layout.triggered_eval_report(ckpt).resolve() != report_file.resolve():
            log.warning("triggered: refused: the report at %s is about %s, not its own checkpoint of this run; "
                        "deploying directly", report_file, ckpt)
            return None
        passing.append(ckpt)
    return passing


def triggered_deployment(cfg, tracking_uri: str, layout: RunLayout, best: dict, checkpoints: list[str],
                         server_status: Callable[[], dict | None] | None = None) -> dict | None:
    """What the triggered deploy-model runs made of this run, in deploy_if_better's shape, read once
    those runs (one per checkpoint of `checkpoints`, passing_triggered_checkpoints) completed: the
    record of the run's checkpoint that is champion now, else a not-deployed result for `best` with
    its gate reason. None if a record is missing or refused (the deploy stage deploys itself).
    `server_status()`: the model server's {url, pid, healthy} (None: not running)."""
    from tasks.deploy.registry import get_champion

    records = []
    for ckpt in checkpoints:
        rec = _verified(layout.triggered_deploy_record(ckpt), DEPLOY_RECORD, "reason", "deploying directly")
        if rec is None:
            return None
        if problem := _not_about(rec, ckpt, f"the deploy record of {ckpt}"):
            log.warning("triggered: %s; deploying directly", problem)
            return None
        records.append(rec)
    champion = get_champion(tracking_uri, cfg.deploy.model_name)
    current = server_status() if server_status else None
    live = {"endpoint": current["url"], "pid": current["pid"]} if current and current["healthy"] else {}
    for rec in records:
        if champion and rec.get("version") is not None and int(rec["version"]) == champion["version"]:
            return {**rec, **live, "deployed_by": DEPLOYED_BY}
    if any(r.get("version") is not None for r in records):
        reason = "a later champion replaced this run's model"
    elif records:
        reason = records[-1]["reason"]  # passed at evaluation time, then the gate or verification failed
    else:
        reason = (best.get("gate") or {}).get("reason", "no checkpoint of this run passed the gate")
    return {"passed": False, "reason": reason, "model_name": cfg.deploy.model_name,
            "val_loss": best.get("val_loss"), "checkpoint": best.get("checkpoint"),
            "champion_version": champion["version"] if champion else None,
            "champion_val_loss": champion["val_loss"] if champion else None,
            "version": None, "alias": None, "content_hash": None, "source": None, "endpoint": None, "pid": None,
            "verified": None, **live, "deployed_by": DEPLOYED_BY}
