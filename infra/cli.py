"""`crucible`: run the pre-training pipeline against an embedded local stack.

Heavy modules (Prefect, MLflow, torch) are imported only after the config has validated, so a bad
config fails in well under a second.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = "configs/tiny.yaml"
REPO_ROOT = Path(__file__).resolve().parent.parent

EXAMPLES = """\
examples:
  crucible up                                  start Prefect + MLflow + the lineage service (+ the deployed model server)
  crucible status                              URLs, health and pids of the local services
  crucible status --json                       the same as JSON: {service: {url, healthy, pid}}
  crucible run configs/tiny.yaml               the whole pipeline: curate → tokenizer → train → evaluate → deploy
  crucible run configs/tiny.yaml --set train.max_steps=50 --summary runs/summary.json
  crucible ablate configs/tiny.yaml            does curation help? langid-only vs curated corpus, same budget
  crucible lineage replay runs/<run>/lineage.jsonl                  send a run's lineage log to the lineage service
  crucible lineage replay runs/<run>/lineage.jsonl --url http://127.0.0.1:9000   ... or to Marquez
  crucible plan --params 7e9                   size a pre-training run: tokens, FLOPs, GPUs, days, cost
  crucible plan --flops 1e22 --gpu h100 --json
  crucible filter docs.jsonl --out decisions.jsonl   why each document is kept or dropped
  crucible dedup docs.jsonl --out clusters.jsonl     exact + MinHash near-duplicate clusters
  crucible down                                stop the model server, the lineage service, MLflow and Prefect
  crucible --state-dir /tmp/crucible up        keep the stack's databases, logs and pid files elsewhere
  crucible up --set stack.prefect_port=4300 --set stack.mlflow_port=5300 --set lineage.service_port=5355

The stack's ports and state directory come from the config (--config, default configs/tiny.yaml;
section `stack`, `lineage` for the lineage service and `deploy` for the model server).
Logs: <state dir>/logs/<service>.log.
"""


TOOLS = (
    ("filter", "tasks.curate.cli",
     "language ID + heuristic filters on JSONL documents: one {id, keep, reason, scores} line per document"),
    ("dedup", "tasks.dedup.cli",
     "exact + MinHash dedup on JSONL documents: one {id, cluster, keep} line per document"),
)


def _parser(with_plan: bool = True, argv_commands: set[str] | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="crucible",
        description="Crucible: an open, auditable pipeline for pre-training language models.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-dir", metavar="DIR",
                   help="stack state directory (databases, logs, pid files); overrides stack.state_dir "
                        "and $CRUCIBLE_STATE_DIR")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def stack_opts(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", default=None, metavar="PATH",
                        help=f"config whose `stack`/`deploy` sections give ports and state dir (default {DEFAULT_CONFIG})")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. stack.prefect_port=4300 (repeatable)")

    sp = sub.add_parser("up", help="start the local stack (idempotent)",
                        description="Start the Prefect server, the MLflow server, the lineage service and, if a "
                                    "model has been deployed, the model server. Healthy services are left alone.")
    stack_opts(sp)
    sp.add_argument("--json", action="store_true", help="print the result as JSON")
    sp = sub.add_parser("down", help="stop the local stack",
                        description="Stop the model server, then the lineage service, MLflow and Prefect "
                                    "(SIGTERM, then SIGKILL).")
    stack_opts(sp)
    sp = sub.add_parser("status", help="show URLs, health and pids of the local services")
    stack_opts(sp)
    sp.add_argument("--json", action="store_true", help="print {service: {url, healthy, pid}} as JSON")
    sp = sub.add_parser("run", help="run the pipeline on CONFIG against the local stack",
                        description="Validate CONFIG, bring the stack up, run the pretrain flow and print links "
                                    "to the Prefect flow run, the MLflow runs, the served model and the lineage log.",
                        epilog="example:\n  crucible run configs/tiny.yaml --set train.max_steps=50 --summary out.json",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("config", metavar="CONFIG", help="pipeline config (YAML)")
    sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. train.max_steps=50 (repeatable)")
    sp.add_argument("--summary", metavar="PATH", help="also write the run's JSON summary to PATH")
    sp.add_argument("--run-name", metavar="NAME", help="run name (default: <config name>-<timestamp>)")

    sp = sub.add_parser("ablate", help="train the same model on the langid-only and the curated corpus; compare "
                                       "held-out loss",
                        description="Validate CONFIG, bring the stack up and run the ablate flow: the same model and "
                                    "token budget on (a) extracted text after language ID only and (b) the fully "
                                    "curated corpus, both scored on WikiText-2 validation (ablate.eval_path).")
    sp.add_argument("config", metavar="CONFIG", help="pipeline config (YAML)")
    sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. train.max_steps=50 (repeatable)")
    sp.add_argument("--out", metavar="PATH", help="also write the JSON result to PATH")

    sp = sub.add_parser("lineage", help="lineage tools: replay a run's lineage log to a lineage endpoint",
                        description="OpenLineage events of every run are in runs/<run>/lineage.jsonl.")
    lsub = sp.add_subparsers(dest="lineage_command", metavar="SUBCOMMAND", required=True)
    rp = lsub.add_parser(
        "replay", help="send lineage.jsonl file(s) to the lineage service (default) or to Marquez",
        description="POST every event of each LOG to the lineage service of the local stack (default; it "
                    "ingests idempotently, so replaying twice is harmless) or to --url, e.g. Marquez. Events "
                    "are sent in batches; a server that takes one event per request (Marquez) is detected.",
        epilog="examples:\n  crucible lineage replay runs/tiny-*/lineage.jsonl\n"
               "  crucible lineage replay runs/<run>/lineage.jsonl --url http://127.0.0.1:9000",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    rp.add_argument("logs", nargs="+", metavar="LOG.jsonl", help="lineage log(s) to send")
    rp.add_argument("--url", help="lineage endpoint: base URL (Marquez: its API, e.g. http://127.0.0.1:9000) or "
                                  "full .../api/v1/lineage URL (default: the stack's lineage service)")
    rp.add_argument("--batch-size", type=int, default=None, metavar="N",
                    help="events per request (default lineage.replay_batch_size)")
    rp.add_argument("--single", action="store_true", help="one event per request")
    stack_opts(rp)

    # Document-level tools; their options (and imports) are mounted only when the command runs.
    for name, module, help_ in TOOLS:
        tp = sub.add_parser(name, help=help_, description=help_)
        if name in (argv_commands or ()):
            __import__(module, fromlist=["add_arguments"]).add_arguments(tp)

    plan_help = "size a pre-training run from a parameter count or a FLOP budget"
    if not with_plan:  # listed in --help; its options are mounted only when it runs (import time)
        sub.add_parser("plan", help=plan_help)
        return p
    from tasks.plan import cli as plan_cli

    sp = sub.add_parser("plan", help=plan_help, description=plan_cli.__doc__.split("\n\n")[0],
                        epilog="examples:\n" + plan_cli.__doc__.split("\n\n")[1].replace("    plan ", "  crucible plan "),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    plan_cli.add_arguments(sp)
    return p


def _fail(msg: str, code: int = 2) -> int:
    print(msg, file=sys.stderr)
    return code


def _load(path: str, overrides: list[str]):
    from tasks.config import load_config

    return load_config(path, overrides)


def _stack_configs(args):
    """(stack, deploy, lineage sections) from --config (default configs/tiny.yaml, looked up in the
    working directory, then in the repository); the defaults if no default config exists."""
    from tasks.config import DeployConfig, LineageConfig, StackConfig, apply_overrides

    path = args.config
    if path is None:
        for candidate in (Path(DEFAULT_CONFIG), REPO_ROOT / DEFAULT_CONFIG):
            if candidate.is_file():
                path = str(candidate)
                break
    if path is not None:
        cfg = _load(path, args.overrides)
        return cfg.stack, cfg.deploy, cfg.lineage
    raw = apply_overrides({}, args.overrides)
    return (StackConfig.model_validate(raw.get("stack", {})), DeployConfig.model_validate(raw.get("deploy", {})),
            LineageConfig.model_validate(raw.get("lineage", {})))


def _print_status(st: dict) -> None:
    for name, s in st.items():
        if not isinstance(s, dict):
            continue
        state = "healthy" if s.get("healthy") else ("running, not healthy" if s.get("pid") else "stopped")
        pid = f"pid {s['pid']}" if s.get("pid") else ""
        print(f"  {name:<13} {state:<21} {s.get('url') or '':<32} {pid}".rstrip())
        if s.get("error"):
            print(f"  {'':<13} {s['error']}")


def cmd_up(args) -> int:
    from infra import stack

    stack_cfg, _, lineage_cfg = _stack_configs(args)
    print(f"starting the local stack in {stack.state_dir(stack_cfg)} ...", file=sys.stderr)
    res = stack.up(stack_cfg, lineage_cfg=lineage_cfg)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        _print_status(res)
        print(f"ready in {res['seconds']:.1f}s; logs in {stack.state_dir(stack_cfg) / 'logs'}")
    return 0


def cmd_down(args) -> int:
    from infra import stack

    stack_cfg, _, _ = _stack_configs(args)
    for name, what in stack.down(stack_cfg).items():
        print(f"  {name:<13} {what}")
    return 0


def cmd_status(args) -> int:
    from infra import stack

    stack_cfg, _, lineage_cfg = _stack_configs(args)
    st = stack.status(stack_cfg, lineage_cfg)
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print(f"state dir: {stack.state_dir(stack_cfg)}")
        _print_status(st)
    return 0 if all(s["healthy"] for s in st.values()) else 1


def cmd_run(args) -> int:
    cfg = _load(args.config, args.overrides)  # ConfigError → exit 2 before anything heavy is imported
    from infra import stack

    print(f"config {args.config} is valid; bringing up the local stack in {stack.state_dir(cfg.stack)} ...",
          file=sys.stderr)
    res = stack.up(cfg.stack, lineage_cfg=cfg.lineage)
    _print_status({k: v for k, v in res.items() if isinstance(v, dict)})
    os.environ.update(stack.client_env(cfg.stack, cfg.lineage))

    from flows.pretrain import run_pipeline  # imports Prefect, which reads PREFECT_API_URL now

    t0 = time.monotonic()
    try:
        summary = run_pipeline(cfg, summary_path=args.summary, run_name=args.run_name)
    except Exception as e:  # noqa: BLE001 - the flow's own logs hold the traceback
        where = f"; summary in {args.summary}" if args.summary else ""
        return _fail(f"crucible: pipeline failed after {time.monotonic() - t0:.0f}s: {e}{where}", 1)
    _print_links(summary, time.monotonic() - t0)
    return 0 if summary.get("status", "COMPLETED") == "COMPLETED" else 1


def cmd_ablate(args) -> int:
    cfg = _load(args.config, args.overrides)
    from infra import stack

    res = stack.up(cfg.stack, lineage_cfg=cfg.lineage)
    _print_status({k: v for k, v in res.items() if isinstance(v, dict)})
    os.environ.update(stack.client_env(cfg.stack, cfg.lineage))
    from flows.ablate import run_ablation_flow

    result = run_ablation_flow(cfg, args.out)
    losses = result["heldout_loss"]
    print(f"\nablation {result['run_name']}: held-out loss langid-only {losses['langid_only']:.4f}, "
          f"curated {losses['curated']:.4f} ({100 * result['relative_improvement']:+.2f} %)")
    print(f"  Result           : {Path(result['run_dir']) / 'ablate' / 'ablation.json'}")
    return 0


def _print_links(summary: dict, seconds: float) -> None:
    mlflow = summary.get("mlflow") or {}
    deploy = (summary.get("stages") or {}).get("deploy") or {}
    print(f"\npipeline {summary.get('run_name', '')} {summary.get('status', '')} in {seconds:.0f}s")
    print(f"  Prefect flow run : {summary.get('prefect_ui_url')}")
    if isinstance(mlflow, dict):
        print(f"  MLflow           : {mlflow.get('tracking_uri')}  (experiment {mlflow.get('experiment')}, "
              f"run {mlflow.get('run_id')})")
    else:
        print(f"  MLflow           : {mlflow}")
    if deploy.get("version") is not None:
        print(f"  Registered model : {deploy.get('model_name')} version {deploy.get('version')} (alias champion)")
    elif deploy.get("reason"):
        print(f"  Deployment gate  : not deployed: {deploy['reason']}")
    print(f"  Served model     : {deploy.get('endpoint')}")
    print(f"  Lineage log      : {summary.get('lineage_log')}")
    lineage = summary.get("lineage") or {}
    if lineage.get("page_url"):
        print(f"  Lineage page     : {lineage['page_url']}")
    http = lineage.get("http") or {}
    if http.get("failed") or http.get("skipped"):
        replayed = lineage.get("replayed") or {}
        note = ("replayed at the end" if replayed.get("events") else
                f"send them with: crucible lineage replay {summary.get('lineage_log')}")
        print(f"  Lineage endpoint : {http.get('url')} missed {http['failed'] + http['skipped']} events "
              f"({http.get('last_error') or 'unavailable'}); {note}")
    print(f"  Run directory    : {summary.get('run_dir')}")


def cmd_lineage(args) -> int:
    from infra import stack

    _, _, lineage_cfg = _stack_configs(args)
    url = args.url or stack.lineage_url(lineage_cfg)
    from tasks.lineage.service.replay import ReplayError, replay

    import httpx

    batch = args.batch_size or lineage_cfg.replay_batch_size
    code = 0
    for path in args.logs:
        try:
            result = replay(path, url, batch_size=batch, single=args.single)
        except (ReplayError, ValueError, OSError, httpx.HTTPError) as e:
            hint = "" if args.url else " (is the stack up? `crucible up`)"
            print(f"crucible: replay of {path} to {url} failed: {e}{hint}", file=sys.stderr)
            code = 1
            continue
        print(json.dumps({"file": path, **result}))
    return code


def cmd_tool(args) -> int:
    module = dict((n, m) for n, m, _ in TOOLS)[args.command]
    return __import__(module, fromlist=["run"]).run(args)


def cmd_plan(args) -> int:
    from tasks.plan import cli as plan_cli

    return plan_cli.run(args)


COMMANDS = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "run": cmd_run, "ablate": cmd_ablate,
            "lineage": cmd_lineage,
            "plan": cmd_plan, "filter": cmd_tool, "dedup": cmd_tool}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    with_plan = "plan" in argv
    if with_plan:  # `--params -7e9` -> `--params=-7e9`, so the planner reports the bad value
        from tasks.plan.cli import _join_negative_values

        argv = _join_negative_values(argv)
    args = _parser(with_plan, {a for a in argv if a in ("filter", "dedup")}).parse_args(argv)
    if args.state_dir:
        os.environ["CRUCIBLE_STATE_DIR"] = str(Path(args.state_dir).expanduser().resolve())
    from tasks.config import ConfigError

    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        return _fail(str(e), 2)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Exception as e:  # noqa: BLE001 - a CLI prints one line, not a traceback, for known failures
        from infra.stack import StackError

        if isinstance(e, StackError):
            return _fail(f"crucible: {e}", 1)
        raise


if __name__ == "__main__":
    sys.exit(main())
