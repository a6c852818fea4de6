"""`plan`: size a pre-training run from a parameter count or a FLOP budget.

    plan --params 7e9                              compute-optimal tokens, FLOPs, time, cost, layout
    plan --params 7e9 --tokens 2e12 --gpus 256 --gpu h100 --mfu 0.45
    plan --flops 1e22                              Chinchilla split of a compute budget
    plan --params 47e9 --active-params 13e9        mixture of experts (FLOPs from the active params)
    plan --params 7e9 --json                       the plan as JSON
    plan --params 7e9 --gpus 8 --emit-config 7b.yaml --config configs/tiny.yaml   tiny.yaml + the plan's layout
    plan --curate 10TB                             curation of 10 TB of WARC: core-hours per stage, nodes, cost
    plan --curate 500GB --input wet --nodes 4      from measured rates in benchmarks/results/*.json

Exit status 0 on success, 2 on missing or invalid input. `add_arguments` and `run` let another CLI
(`crucible plan`) mount the same options on a subcommand.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from tasks.plan.planner import DEFAULT_VOCAB, PlanError, make_plan
from tasks.plan.curate import INPUT_FORMATS, make_curate_plan
from tasks.plan.report import format_curate_plan, format_plan


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _count(text: str) -> int:
    value = _number(text)  # accepts 1024 and 1.024e3 alike
    if value != int(value):
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}")
    return int(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    size = p.add_argument_group("model and data (give --params or --flops, or both)")
    size.add_argument("--params", type=_number, metavar="N", help="parameter count (MoE: the total), e.g. 7e9")
    size.add_argument("--tokens", type=_number, metavar="D", help="training tokens (default: 20 x params)")
    size.add_argument("--flops", type=_number, metavar="C", help="compute budget in FLOPs, 6·N·D convention")
    size.add_argument("--active-params", type=_number, metavar="N",
                      help="MoE: parameters active per token (drive the FLOPs)")
    size.add_argument("--seq-len", type=_count, default=4096, metavar="T", help="sequence length (default 4096)")
    size.add_argument("--n-layer", type=_count, metavar="L", help="layers (default: estimated from params)")
    size.add_argument("--d-model", type=_count, metavar="D", help="model width (default: estimated from params)")
    size.add_argument("--n-head", type=_count, metavar="H", help="attention heads (default: d_model / 128)")
    size.add_argument("--n-experts", type=_count, metavar="E",
                      help="MoE: routed experts per layer (default: as many as --params holds)")
    size.add_argument("--top-k", type=_count, default=2, metavar="K", help="MoE: experts per token (default 2)")
    size.add_argument("--vocab", type=_count, default=None, metavar="V",
                      help=f"vocabulary size: the output layer's log-probs count toward activation memory "
                           f"(default: --config's tokenizer.vocab_size, else {DEFAULT_VOCAB:,}, Llama 3's)")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--gpus", type=_count, metavar="G",
                    help="GPU count (default: the fewest that finish within plan.target_days)")
    hw.add_argument("--gpu", default=None, help="GPU type from plan.gpus (default: the config's plan.gpu, h100)")
    hw.add_argument("--mfu", type=_number, metavar="F", help="model FLOPs utilisation, 0-1 (default plan.mfu, 0.4)")
    hw.add_argument("--config", metavar="PATH", help="pipeline config whose `plan` section (GPU table, "
                                                     "prices, sizing rules) to use; with --emit-config, the "
                                                     "config the planned settings are merged into")
    out = p.add_argument_group("config for the trainer")
    out.add_argument("--emit-config", metavar="PATH",
                     help="write the plan's settings (train.parallel, micro-batch, activation checkpointing, "
                          "processes, model shape, model.moe) as YAML: --config merged with them, a config "
                          "`crucible run PATH` runs unchanged, or without --config the fragment alone; "
                          "validated as the trainer validates a config first")
    out.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                     help="multi-node plans: train.rdzv_endpoint, the first node's host:port "
                          "(default node-0:29500)")
    cur = p.add_argument_group("curation (--curate SIZE instead of --params / --flops)")
    cur.add_argument("--curate", metavar="SIZE", help="corpus size to curate: 10TB, 500GB, 1.5TiB or bytes")
    cur.add_argument("--input", dest="input_format", default="warc.gz", choices=INPUT_FORMATS,
                     help="what SIZE measures: compressed WARC (default), compressed extracted text (wet), "
                          "or plain text; bytes per page from benchmarks/results/page_sizes.json")
    cur.add_argument("--nodes", type=_count, help="node count (default: the fewest within --target-hours)")
    cur.add_argument("--target-hours", type=_number, help="wall clock to fit in (default plan.curate.target_hours, 24)")
    cur.add_argument("--cores-per-node", type=_count, help="CPUs per node (default plan.curate.cores_per_node, 64)")
    cur.add_argument("--node-price", type=_number, help="USD per node-hour (default plan.curate.node_price_per_hour: "
                                                        "AWS m7i.16xlarge on-demand us-east-1, $3.2256)")
    cur.add_argument("--storage-price", type=_number, help="USD per GB-month (default plan.curate."
                                                           "storage_price_per_gb_month: S3 Standard, $0.023)")
    cur.add_argument("--rates-dir", metavar="DIR", help="benchmark results to read the rates from "
                                                       "(default benchmarks/results)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def build_parser(prog: str = "plan") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                epilog="examples:\n" + __doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def _curate_plan(args: argparse.Namespace, cfg) -> dict:
    if args.params or args.flops or args.tokens:
        raise PlanError("--curate plans curation; give it without --params / --tokens / --flops")
    from tasks.config import CuratePlanConfig

    curate = cfg.curate if cfg else CuratePlanConfig()
    overrides = {"target_hours": args.target_hours, "cores_per_node": args.cores_per_node,
                 "node_price_per_hour": args.node_price, "storage_price_per_gb_month": args.storage_price}
    curate = curate.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    return make_curate_plan(args.curate, args.input_format, args.nodes, curate, args.rates_dir)


def run(args: argparse.Namespace) -> int:
    """Plan from parsed arguments; print it; 0 on success, 2 on bad input."""
    try:
        cfg = energy = full = None
        if args.config:
            from infra.settings import load_config
            from tasks.config import ConfigError

            try:
                full = load_config(args.config)
                cfg, energy = full.plan, full.energy  # energy: the grid intensity and TDPs runs are measured with
            except ConfigError as e:
                raise PlanError(str(e)) from None
        if args.curate is not None:
            plan = _curate_plan(args, cfg)
            print(json.dumps(plan, indent=2) if args.json else format_curate_plan(plan))
            return 0
        # the vocabulary `crucible run` would train (its tokenizer's size), unless --vocab names one
        vocab, vocab_from = ((args.vocab, "--vocab") if args.vocab else
                             (full.tokenizer.vocab_size, f"tokenizer.vocab_size of {args.config}") if full else
                             (DEFAULT_VOCAB, "default, Llama 3's (give --vocab or --config)"))
        plan = make_plan(params=args.params, tokens=args.tokens, flops=args.flops, gpus=args.gpus,
                         gpu=args.gpu or (cfg.gpu if cfg else "h100"), mfu=args.mfu, seq_len=args.seq_len,
                         n_layer=args.n_layer, d_model=args.d_model, active_params=args.active_params, cfg=cfg,
                         n_head=args.n_head, n_experts=args.n_experts,
                         top_k=args.top_k if args.active_params else 2, energy=energy,
                         vocab_size=vocab)
        plan["assumptions"].append(f"vocab_size {vocab:,}: {vocab_from}")
        if full and full.train.doc_mask and plan["layout"]["cp"] > 1:
            _warn_doc_mask_under_cp(plan, args.seq_len)
        if args.emit_config:
            _emit(plan, args, cfg)
    except PlanError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


def _warn_doc_mask_under_cp(plan: dict, seq_len: int) -> None:
    """train.doc_mask with cp > 1: attention then takes the boolean-mask path (tasks/train/context_parallel.py),
    whose masks the activation estimate does not count; say so on stderr and in the assumptions."""
    cp = plan["layout"]["cp"]
    gb = 2 * seq_len * seq_len / cp / 1e9  # bool (local, seq_len) causal mask + (1, 1, local, seq_len) document mask
    warning = (f"WARNING: train.doc_mask with cp={cp}: each rank also builds a (seq_len/cp, seq_len) boolean "
               f"causal mask and a (micro_batch, 1, seq_len/cp, seq_len) document mask, {gb:.1f} GB at micro-batch "
               "1, not counted in the activation estimate (and no flash kernel); turn doc_mask off or leave that room")
    plan["assumptions"].append(warning)
    print(f"plan: {warning}", file=sys.stderr)


def _emit(plan: dict, args: argparse.Namespace, cfg) -> None:
    """--emit-config: the plan's trainer settings, validated, written to args.emit_config."""
    from tasks.config import ConfigError, PlanConfig
    from tasks.plan.emit import config_fragment, write_config

    if not plan["layout"]["fits"]:
        raise PlanError(f"the model does not fit on {plan['gpus']} x {plan['gpu']}: no config is written "
                        "(more GPUs, GPUs with more memory, or a smaller model)")
    lay = plan["layout"]
    header = (f"# crucible plan: {plan['params']:.3g} params on {plan['gpus']} x {plan['gpu']}: tp {lay['tp']} x "
              f"pp {lay['pp']} x cp {lay['cp']} x dp {lay['dp']} (dp_shard {lay['dp_shard']} x dp_replicate {lay['dp_replicate']})\n"
              + ("" if args.config else "# a fragment: merge it into a pipeline config (or rerun with --config "
                                        "BASE to write BASE with it merged in)\n"))
    fragment = config_fragment(plan, (cfg or PlanConfig()).gpus_per_node, args.rdzv_endpoint)
    try:
        write_config(fragment, args.emit_config, base=args.config, header=header)
    except ConfigError as e:
        raise PlanError(f"the planned settings do not validate: {e}") from None
    print(f"plan: wrote {'the config' if args.config else 'the config fragment'} to {args.emit_config}",
          file=sys.stderr)


def join_negative_values(argv: list[str]) -> list[str]:
    """`--params -7e9` -> `--params=-7e9`, so argparse reports the bad value, not a missing one."""
    out: list[str] = []
    for item in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and item.startswith("-"):
            try:
                float(item)
            except ValueError:
                pass
            else:
                out[-1] = f"{out[-1]}={item}"
                continue
        out.append(item)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(join_negative_values(sys.argv[1:] if argv is None else list(argv)))
    except SystemExit as e:  # argparse: usage error (2) or --help (0)
        return int(e.code or 0)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
