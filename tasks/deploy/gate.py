"""The deployment gate: a checkpoint is promoted only if its validation loss is below an absolute
threshold and better than the current champion's by at least `min_improvement`."""
from __future__ import annotations

import math


def gate(deploy_cfg, eval_result: dict, champion_val_loss: float | None) -> dict:
    """{"passed": bool, "reason": str}. `deploy_cfg` is the config's DeployConfig section.

    Passes iff val_loss < max_val_loss and, when there is a champion,
    champion_val_loss - val_loss > 0 and >= min_improvement.
    """
    loss = eval_result.get("val_loss")
    if not isinstance(loss, (int, float)) or isinstance(loss, bool) or not math.isfinite(loss):
        return {"passed": False, "reason": f"no finite val_loss in the evaluation (got {loss!r})"}
    limit = deploy_cfg.max_val_loss
    if loss >= limit:
        return {"passed": False, "reason": f"val_loss {loss:.4f} is not below max_val_loss {limit:.4f}"}
    if champion_val_loss is None:
        return {"passed": True, "reason": f"val_loss {loss:.4f} < max_val_loss {limit:.4f}; no champion yet"}
    delta = deploy_cfg.min_improvement
    gain = champion_val_loss - loss
    if gain <= 0 or gain < delta:
        return {"passed": False,
                "reason": f"val_loss {loss:.4f} does not beat the champion's {champion_val_loss:.4f} "
                          f"by at least {delta:g} (improvement {gain:+.4f})"}
    return {"passed": True,
            "reason": f"val_loss {loss:.4f} < max_val_loss {limit:.4f} and beats the champion's "
                      f"{champion_val_loss:.4f} by {gain:.4f} (>= {delta:g})"}
