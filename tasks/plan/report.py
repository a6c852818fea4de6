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
        ("shape", f"{plan['n_layer']} layers x d_model {plan['d_model']} ({plan['n_head']} heads), seq_len "
                  f"{plan['seq_len']}" + (" (estimated)" if plan["shape_estimated"] else "")
                  + (f"; {plan['moe']['n_experts']} experts of width {plan['moe']['expert_hidden']}, top-"
                     f"{plan['moe']['top_k']}" if plan.get("moe") else "")),
        ("tokens", f"{_si(plan['tokens'])} ({plan['tokens_per_param']:.1f} per {'active ' if moe else ''}param)"),
        ("training FLOPs", f"{plan['flops']:.3e} (6ND {plan['flops_6nd']:.3e}, attention "
                           f"{plan['attention_flops_fraction']:.1%})"),
        ("hardware", f"{plan['gpus']} x {plan['gpu']} at {plan['mfu']:.0%} MFU "
                     f"({plan['peak_flops_per_gpu'] / 1e12:g} TFLOP/s peak each)"),
        ("wall clock", f"{plan['days']:,.2f} days ({plan['seconds']:,.0f} s)"),
        ("GPU hours", f"{plan['gpu_hours']:,.0f}"),
        ("cost", f"${plan['cost_usd']:,.0f}"),
        ("energy", "unknown (no TDP for this GPU: set energy.gpu_tdp_w)" if plan.get("energy_kwh") is None else
                   f"{plan['energy_kwh']:,.0f} kWh, {plan['co2e_kg'] / 1000:,.1f} t CO2e"),
        ("checkpoint", _bytes(plan["checkpoint_bytes"])),
        ("model states", _bytes(plan["model_state_bytes"])),
        ("layout", f"tp={lay['tp']} pp={lay['pp']} " + (f"cp={lay['cp']} " if lay.get("cp", 1) > 1 else "")
                   + f"dp={lay['dp']} (dp_shard {lay['dp_shard']} x dp_replicate "
                   f"{lay['dp_replicate']}), {lay['microbatches']} microbatch(es), "
                   f"bubble {lay['bubble_fraction']:.1%}" + ("" if lay["fits"] else "  ** does not fit **")),
    ]
    width = max(len(k) for k, _ in rows)
    out = [f"  {k:<{width}} : {v}" for k, v in rows]
    out.append(f"  {'why':<{width}} : " + lay["rationale"].replace("; ", f"\n  {'':<{width}}   "))
    out.append("assumptions:")
    out += [f"  - {a}" for a in plan["assumptions"]]
    return "\n".join(out)


def format_curate_plan(plan: dict) -> str:
    """A curation plan (tasks.plan.curate.make_curate_plan) as a per-stage table plus totals."""
    per_page = plan["bytes_per_page"]
    out = [f"  input      : {_bytes(plan['size_bytes'])} of {plan['input_format']} = {_si(plan['pages'])} pages "
           f"at {per_page['value']:,.0f} bytes each ({per_page['file']} {per_page['key']})",
           f"  rates from : {plan['rates_dir']}", ""]
    header = ("stage", "items in", "rate per core", "core-hours", "keep", "rate source")
    rows = [(s["stage"], f"{_si(s['items_in'])} {s['unit']}", f"{s['rate']['value']:,.1f} {s['unit']}/s",
             f"{s['core_hours']:,.0f}", f"{s['keep']['value']:.3f}",
             f"{s['rate']['file']} {s['rate']['key']}" + ("" if s["rate"]["measured"] else "  ** NOT MEASURED: stand-in **"))
            for s in plan["stages"]]
    rows.append(("total", "", "", f"{plan['core_hours']:,.0f}", "", ""))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
    for r in [header, *rows]:
        out.append("  " + "  ".join(f"{c:<{w}}" if i in (0, 1) else f"{c:>{w}}" for i, (c, w) in
                                    enumerate(zip(r, widths))) + "  " + r[5])
    st = plan["storage"]
    out += ["",
            f"  cluster    : {plan['nodes']} node(s) x {plan['cores_per_node']} cores, {plan['hours']:,.1f} h wall clock "
            f"({plan['node_hours']:,.1f} node-hours)",
            f"  storage    : input {_bytes(st['input_bytes'])} + intermediate {_bytes(st['intermediate_bytes'])} + output "
            f"{_bytes(st['output_bytes'])} (curated text {_bytes(st['curated_text_bytes'])}, {_si(st['tokens'])} tokens) "
            f"= {_bytes(st['total_bytes'])}",
            f"  cost       : compute ${plan['compute_cost_usd']:,.0f} (at ${plan['node_price_per_hour']:g}/node-hour) + "
            f"storage ${st['cost_usd_per_month']:,.0f} for one month (at ${st['price_per_gb_month']:g}/GB-month) "
            f"= ${plan['total_cost_usd']:,.0f}",
            "keep fractions:"]
    out += [f"  - {s['stage']}: " + (s["keep"]["note"] if s["keep"]["file"] == "-" else
                                    f"{s['keep']['file']} {s['keep']['key']}")
            for s in plan["stages"]]
    if plan["not_measured"]:
        out.append("NOT MEASURED (stand-in rates): " + ", ".join(plan["not_measured"]))
    out.append("assumptions:")
    out += [f"  - {a}" for a in plan["assumptions"]]
    return "\n".join(out)
