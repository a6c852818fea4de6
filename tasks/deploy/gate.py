"""The absolute part of the deployment gate: a checkpoint is considered only if its validation
loss is finite and below deploy.max_val_loss. Against a champion, the comparison is made on the
fixed yardstick (tasks/deploy/yardstick.py): val_loss figures of different runs are measured on
different splits with different tokenizers and are not comparable."""
from __future__ import annotations

import math
from pathlib import Path

# A gate record (the yardstick stage's gate.json, gate/gate-step-N.json: both models' scores and the
# decision) is signed when written (tasks/core/signing.py), so a rewritten one is refused as forged
GATE_RECORD = "gate-record"


def write_gate_record(path: str | Path, record: dict) -> Path:
    """Write a gate record, signed (readable JSON; the signature is one more field)."""
    from tasks.core.signing import write_signed

    return write_signed(path, record, GATE_RECORD)


def read_gate_record(path: str | Path) -> dict:
    """A signed gate record; SignatureError (logged as refused) if it is unsigned or was rewritten."""
    from tasks.core.signing import read_signed

    return read_signed(path, GATE_RECORD)


def gate(deploy_cfg, eval_result: dict) -> dict:
    """{"passed": bool, "reason": str}: passes iff val_loss is finite and < deploy_cfg.max_val_loss."""
    loss = eval_result.get("val_loss")
    if not isinstance(loss, (int, float)) or isinstance(loss, bool) or not math.isfinite(loss):
        return {"passed": False, "reason": f"no finite val_loss in the evaluation (got {loss!r})"}
    limit = deploy_cfg.max_val_loss
    if loss >= limit:
        return {"passed": False, "reason": f"val_loss {loss:.4f} is not below max_val_loss {limit:.4f}"}
    return {"passed": True, "reason": f"val_loss {loss:.4f} < max_val_loss {limit:.4f}; no champion yet"}
