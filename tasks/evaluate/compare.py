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

from tasks.core import fs
from tasks.core.layout import RunLayout
from tasks.core.storage import stored


def table_key(run_name: str) -> str:
    """Prefect artifact key of a run's checkpoint table (lowercase letters, digits, dashes)."""
    slug = re.sub(r"[^a-z0-9]+", "-", (run_name or "run").lower()).strip("-") or "run"
    return f"eval-checkpoints-{slug}"[:200]


def _report_files(folder: Path) -> list[tuple[Path, float, str | Path, dict | None]]:
    """(path in the run's layout, modification time, where to read it, fsspec options) of each JSON
    file under `folder`; of an object-store run also the store's objects (the triggered flows push
    their reports from any machine), the newer of the two where both are there (this process's
    report is local until its stage's push)."""
    local = {p: (p.stat().st_mtime, p, None) for p in folder.rglob("*.json")} if folder.is_dir() else {}
    at, options = stored(folder)
    if fs.is_remote(at):
        prefix = at.split("://", 1)[1].rstrip("/") + "/"
        try:
            found = fs.store_fs(at, options).find(at, detail=True)
        except FileNotFoundError:
            found = {}
        for key, info in found.items():
            if not (key.endswith(".json") and key.startswith(prefix)):
                continue
            try:
                place = fs.safe_join(folder, key[len(prefix):])
            except fs.PathEscape:
                continue
            modified = info.get("LastModified")
            mtime = modified.timestamp() if modified else 0.0
            if place not in local or mtime > local[place][0]:
                local[place] = (mtime, fs.join(at, key[len(prefix):]), options)
    return [(p, *local[p]) for p in sorted(local)]


def _reports(layout: RunLayout) -> dict[int, tuple[float, Path, dict]]:
    from tasks.core.signing import loads_signed
    from tasks.evaluate.evaluate import REPORT_PURPOSE

    newest: dict[int, tuple[float, Path, dict]] = {}
    for path, mtime, where, options in _report_files(layout.stage_dir("evaluate", create=False)):
        try:  # signed: a planted or edited report is not shown (logged as refused)
            report = loads_signed(fs.read_bytes(where, options), REPORT_PURPOSE, what=str(where))
        except (OSError, ValueError):
            continue  # gone, or not a report the pipeline wrote (SignatureError is a ValueError)
        if not isinstance(report, dict) or not isinstance(report.get("step"), int) or "val_loss" not in report:
            continue
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

