"""All checkpoints of a run side by side: one row per evaluated checkpoint, from the evaluation
reports under run_dir/evaluate (direct: evaluate/step-N.json; event-triggered:
evaluate/triggered/step-N.json; one report a step, chosen by `_reports`; only signed reports of this
run's own checkpoints count).

Each row: step, checkpoint, val_loss, perplexity, every task-suite metric, the deployment gate's
verdict at evaluation time (report["gate"], written by whoever gated it; its reason holds both
models' bits per byte), the yardstick's sha256 (first 12 digits) and whether it is the
run's best. Publishing it (a Prefect table artifact keyed per run) is the Prefect side's job
(flows/artifacts.publish_eval_table)."""
from __future__ import annotations

import re
from pathlib import Path

from tasks.core import fs
from tasks.core.layout import RunLayout
from tasks.core.storage import stored


def table_key(run_name: str) -> str:
    """Prefect artifact key of a run's checkpoint table (lowercase letters, digits, dashes)."""
    slug = re.sub(r"[^a-z0-9]+", "-", (run_name or "run").lower()).strip("-") or "run"
    return f"eval-checkpoints-{slug}"[:200]


def _report_copies(folder: Path) -> dict[Path, list[tuple[str | Path, dict | None, bool]]]:
    """Path in the run's layout -> the copies of that JSON file under `folder` to read: (where, fsspec
    options, from the store). Of an object-store run also the store's objects (the triggered flows push
    their reports from any machine); a key not in normal form (`fs.normal_uri`) is another object
    than the path it collapses to, and is skipped."""
    copies: dict[Path, list] = {p: [(p, None, False)] for p in folder.rglob("*.json")} if folder.is_dir() else {}
    at, options = stored(folder)
    if fs.is_remote(at):
        for rel in fs.files(at, options):
            try:
                place = fs.safe_join(folder, fs.normal_uri(fs.join(at, rel))[len(at) + 1:])
            except fs.PathEscape:
                continue
            if place.suffix == ".json":
                copies.setdefault(place, []).append((fs.join(at, rel), options, True))
    return copies


def _verified_report(where: str | Path, options: dict | None, layout: RunLayout) -> dict | None:
    """The signed report at `where` when it is one of this run's checkpoints' (a planted or edited
    file, or another run's genuine report copied here, is not shown)."""
    from tasks.core.signing import loads_signed
    from tasks.evaluate.evaluate import REPORT_PURPOSE

    try:
        report = loads_signed(fs.read_bytes(where, options), REPORT_PURPOSE, what=str(where))
    except (OSError, ValueError):
        return None  # gone, or not a report the pipeline wrote (SignatureError is a ValueError)
    if not isinstance(report, dict) or not isinstance(report.get("step"), int) or "val_loss" not in report:
        return None
    return report if layout.owns(str(report.get("checkpoint") or "")) else None


def _reports(layout: RunLayout) -> dict[int, tuple[Path, dict]]:
    """step -> (path in the layout, report) of the report that stands for the step, chosen from signed
    content and who writes which file, never by clocks (a local mtime against the store's LastModified
    is clock skew; either can be set by a writer): a gated report over an ungated one (write_gate
    rewrites a report with its verdict); between two copies of one file, the store's for a triggered
    report (its flows push it from any machine: a working copy's may be older) and this working copy's
    for a direct one (the pretrain flow writes it here; the store has what was pushed of it); between
    the direct and the triggered report of a step the direct one (the pretrain flow evaluates itself
    only when it did not take the triggered report). The reports carry no signed time to order them."""
    chosen: dict[int, tuple[tuple, Path, dict]] = {}
    for path, copies in sorted(_report_copies(layout.stage_dir("evaluate", create=False)).items()):
        triggered = path.parent == layout.triggered_eval_dir
        for where, options, from_store in copies:
            report = _verified_report(where, options, layout)
            if report is None:
                continue
            rank = ("gate" in report, not triggered, from_store == triggered)
            if report["step"] not in chosen or rank > chosen[report["step"]][0]:
                chosen[report["step"]] = (rank, path, report)
    return {step: (path, report) for step, (_, path, report) in chosen.items()}


def gate_text(gate: dict | None) -> str | None:
    if not isinstance(gate, dict):
        return None
    return ("passed: " if gate.get("passed") else "failed: ") + str(gate.get("reason", ""))


def checkpoint_rows(run_dir: str | Path) -> list[dict]:
    """The run's checkpoints in step order; every row has the same columns."""
    layout = RunLayout(run_dir)
    found = _reports(layout)
    metrics = sorted({k for _, r in found.values() for k in (r.get("task_metrics") or {})})
    losses = [r["val_loss"] for _, r in found.values() if isinstance(r.get("val_loss"), (int, float))]
    best = min(losses, default=None)
    rows = []
    for step in sorted(found):
        path, r = found[step]
        tm = r.get("task_metrics") or {}
        rows.append({"step": step, "checkpoint": Path(str(r.get("checkpoint", ""))).name or None,
                     "val_loss": r.get("val_loss"), "perplexity": r.get("perplexity"),
                     **{m: tm.get(m) for m in metrics},
                     "gate": gate_text(r.get("gate")),
                     "yardstick": ((r.get("gate") or {}).get("yardstick_sha256") or "")[:12] or None,
                     "best": best is not None and r.get("val_loss") == best,
                     "evaluated_by": "trigger" if path.parent == layout.triggered_eval_dir else "pretrain flow"})
    return rows

