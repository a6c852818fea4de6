"""A plan (tasks.plan.planner.make_plan) as the human-readable table that `crucible plan` prints and
the plan stage publishes."""
from __future__ import annotations


def _si(x: float, unit: str = "") -> str:
    for factor, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= factor:
            return f"{x / factor:.2f}{suffix}{unit}"
    return f"{x:.3g}{unit}"


def _bytes(n: float) -> str:
    for factor, suffix in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= factor:
            return f"{n / factor:.1f} {suffix}"
    return f"{n:.0f} B"


def format_plan(plan: dict) -> str:
    lay = plan["layout"]
    moe = plan["active_params"] != plan["params"]
    rows = [
        ("parameters", _si(plan["params"]) + (f" total, {_si(plan['active_params'])} active" if moe else "")),
        ("shape", f"{plan['n_layer']} layers x d_model {plan['d_model']}, seq_len {plan['seq_len']}"
                  + (" (estimated)" if plan["shape_estimated"] else "")),
        ("tokens", f"{_si(plan['tokens'])} ({plan['tokens_per_param']:.1f} per {'active ' if moe else ''}param)"),
        ("training FLOPs", f"{plan['flops']:.3e} (6ND {plan['flops_6nd']:.3e}, attention "
                           f"{plan['attention_flops_fraction']:.1%})"),
        ("hardware", f"{plan['gpus']} x {plan['gpu']} at {plan['mfu']:.0%} MFU "
                     f"({plan['peak_flops_per_gpu'] / 1e12:g} TFLOP/s peak each)"),
        ("wall clock", f"{plan['days']:,.2f} days ({plan['seconds']:,.0f} s)"),
        ("GPU hours", f"{plan['gpu_hours']:,.0f}"),
        ("cost", f"${plan['cost_usd']:,.0f}"),
        ("checkpoint", _bytes(plan["checkpoint_bytes"])),
        ("model states", _bytes(plan["model_state_bytes"])),
        ("layout", f"tp={lay['tp']} pp={lay['pp']} dp={lay['dp']}, {lay['microbatches']} microbatch(es), "
                   f"bubble {lay['bubble_fraction']:.1%}" + ("" if lay["fits"] else "  ** does not fit **")),
    ]
    width = max(len(k) for k, _ in rows)
    out = [f"  {k:<{width}} : {v}" for k, v in rows]
    out.append(f"  {'why':<{width}} : " + lay["rationale"].replace("; ", f"\n  {'':<{width}}   "))
    out.append("assumptions:")
    out += [f"  - {a}" for a in plan["assumptions"]]
    return "\n".join(out)
