"""All checkpoints of a run side by side: one row per evaluated checkpoint, from the evaluation
reports under run_dir/evaluate (direct: evaluate/step-N.json; event-triggered:
evaluate/triggered/step-N.json; the newest report of a step wins; only signed reports count).

Each row: step, checkpoint, val_loss, perplexity, every task-suite metric, the deployment gate's
verdict at evaluation time (report["gate"], written by whoever gated it; its reason holds both
models' bits per byte), the yardstick's sha256 (first 12 digits) and whether it is the
run's best. Publishing it (a Prefect table artifact keyed per run) is the Prefect side's job
(flows/artifacts.publish_eval_table)."""
from __future__ import annotations

import re
from pathlib import Path

from tasks.core.layout import RunLayout


def table_key(run_name: str) -> str:
    """Prefect artifact key of a run's checkpoint table (lowercase letters, digits, dashes)."""
    slug = re.sub(r"[^a-z0-9]+", "-", (run_name or "run").lower()).strip("-") or "run"
    return f"eval-checkpoints-{slug}"[:200]


def _reports(layout: RunLayout) -> dict[int, tuple[float, Path, dict]]:
    from tasks.evaluate.evaluate import read_report

    newest: dict[int, tuple[float, Path, dict]] = {}
    for path in sorted(layout.stage_dir("evaluate", create=False).rglob("*.json")):
        try:
            report = read_report(path)  # signed: a planted or edited report is not shown (logged as refused)
        except (OSError, ValueError):
            continue  # gone, or not a report the pipeline wrote (SignatureError is a ValueError)
        if not isinstance(report, dict) or not isinstance(report.get("step"), int) or "val_loss" not in report:
            continue
        mtime = path.stat().st_mtime
        if report["step"] not in newest or mtime >= newest[report["step"]][0]:
            newest[report["step"]] = (mtime, path, report)
    return newest


def gate_text(gate: dict | None) -> str | None:
    if not isinstance(gate, dict):
        return None
    return ("passed: " if gate.get("passed") else "failed: ") + str(gate.get("reason", ""))


def checkpoint_rows(run_dir: str | Path) -> list[dict]:
    """The run's checkpoints in step order; every row has the same columns."""
    layout = RunLayout(run_dir)
    found = _reports(layout)
    metrics = sorted({k for _, _, r in found.values() for k in (r.get("task_metrics") or {})})
    losses = [r["val_loss"] for _, _, r in found.values() if isinstance(r.get("val_loss"), (int, float))]
    best = min(losses, default=None)
    rows = []
    for step in sorted(found):
        _, path, r = found[step]
        tm = r.get("task_metrics") or {}
        rows.append({"step": step, "checkpoint": Path(str(r.get("checkpoint", ""))).name or None,
                     "val_loss": r.get("val_loss"), "perplexity": r.get("perplexity"),
                     **{m: tm.get(m) for m in metrics},
                     "gate": gate_text(r.get("gate")),
                     "yardstick": ((r.get("gate") or {}).get("yardstick_sha256") or "")[:12] or None,
                     "best": best is not None and r.get("val_loss") == best,
                     "evaluated_by": "trigger" if path.parent == layout.triggered_eval_dir else "pretrain flow"})
    return rows

