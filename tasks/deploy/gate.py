"""The absolute part of the deployment gate: a checkpoint is considered only if its validation
loss is finite and below deploy.max_val_loss. Against a champion, the comparison is made on the
fixed yardstick (tasks/deploy/yardstick.py): val_loss figures of different runs are measured on
different splits with different tokenizers and are not comparable."""
from __future__ import annotations

import math


def gate(deploy_cfg, eval_result: dict) -> dict:
    """{"passed": bool, "reason": str}: passes iff val_loss is finite and < deploy_cfg.max_val_loss."""
    loss = eval_result.get("val_loss")
    if not isinstance(loss, (int, float)) or isinstance(loss, bool) or not math.isfinite(loss):
        return {"passed": False, "reason": f"no finite val_loss in the evaluation (got {loss!r})"}
    limit = deploy_cfg.max_val_loss
    if loss >= limit:
        return {"passed": False, "reason": f"val_loss {loss:.4f} is not below max_val_loss {limit:.4f}"}
    return {"passed": True, "reason": f"val_loss {loss:.4f} < max_val_loss {limit:.4f}; no champion yet"}
