"""The `crucible` argument parser and dispatch.

Heavy modules (Prefect, MLflow, torch) are imported only after the config has validated, so a bad
config fails in well under a second.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from infra.cli import commands
from infra.cli.commands import DEFAULT_CONFIG
from infra.stack import STATE_DIR_ENV, StackError

EXAMPLES = """\
examples:
  crucible up                                  start Prefect + MLflow + the lineage service + the worker (+ the deployed model server)
  crucible up --config configs/continue.yaml   ... with the pretrain (and scheduled) deployments on that config
  crucible up --ray                            ... and a Ray cluster: a head and 2 worker nodes (stack.ray=cluster)
  crucible status                              URLs, health and pids of the local services
  crucible status --json                       the same as JSON: {service: {url, healthy, pid}}
  crucible login                               the MLflow and Prefect UIs' URLs and logins (from the secrets folder)
  crucible run configs/tiny.yaml               the whole pipeline: curate → tokenizer → train → evaluate → deploy
  crucible run configs/tiny.yaml --set train.max_steps=50 --summary runs/summary.json
  crucible curate configs/tiny.yaml --summary runs/curation.json   curation alone: ingest → curate → quality
  crucible ablate configs/tiny.yaml            does curation help? langid-only vs curated corpus, same budget
  crucible lineage replay runs/<run>/lineage.jsonl                  send a run's lineage log to the lineage service
  crucible lineage replay runs/<run>/lineage.jsonl --url http://127.0.0.1:9000   ... or to Marquez
  crucible plan --params 7e9                   size a pre-training run: tokens, FLOPs, GPUs, days, cost
  crucible plan --flops 1e22 --gpu h100 --json
  crucible filter docs.jsonl --out decisions.jsonl   why each document is kept or dropped
  crucible dedup docs.jsonl --out clusters.jsonl     exact + MinHash near-duplicate clusters
  crucible down                                stop the model server, the worker, the lineage service, MLflow and Prefect
  crucible --state-dir /tmp/crucible up        keep the stack's databases, logs and pid files elsewhere
  crucible up --set stack.prefect_port=4300 --set stack.mlflow_port=5300 --set lineage.service_port=5355

The stack's ports and state directory come from the config (--config, default configs/tiny.yaml;
section `stack`, `lineage` for the lineage service and `deploy` for the model server). `crucible up`
registers the config as the parameters of the `pretrain` deployment the worker runs (the Prefect
UI's Run).
Logs: <state dir>/logs/<service>.log.
"""

# Document-level tools: (command, module with add_arguments/run, help).
TOOLS = (
    ("filter", "infra.cli.filter",
     "language ID + heuristic filters on JSONL documents: one {id, keep, reason, scores} line per document"),
    ("dedup", "infra.cli.dedup",
     "exact + MinHash dedup on JSONL documents: one {id, cluster, keep} line per document"),
)
PLAN_HELP = "size a pre-training run from a parameter count or a FLOP budget"


def _add_overrides(sp: argparse.ArgumentParser, example: str) -> None:
    sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help=f"override a config value, e.g. {example} (repeatable)")


def _add_stack_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--config", default=None, metavar="PATH",
                    help=f"config whose `stack`/`deploy` sections give ports and state dir (default {DEFAULT_CONFIG})")
    _add_overrides(sp, "stack.prefect_port=4300")


def _add_stack_commands(sub) -> None:
    sp = sub.add_parser("up", help="start the local stack (idempotent)",
                        description="Start the Prefect server, the MLflow server, the lineage service, the Prefect "
                                    "worker of the `crucible` work pool with the deployments it runs (pretrain on "
                                    "the config, the event-triggered evaluate/deploy flows, the scheduled "
                                    "continue-pretraining) and, if a model has been deployed, the model server. "
                                    "Healthy services are left alone.")
    _add_stack_options(sp)
    sp.add_argument("--json", action="store_true", help="print the result as JSON")
    sp.add_argument("--ray", action="store_true",
                    help="also start a Ray cluster (stack.ray=cluster): a head and stack.ray_workers worker nodes; "
                         "runs attach to it while it is up")
    sp = sub.add_parser("down", help="stop the local stack",
                        description="Stop the model server, the worker and its flow runs, then the lineage "
                                    "service, MLflow and Prefect (SIGTERM, then SIGKILL).")
    _add_stack_options(sp)
    sp = sub.add_parser("status", help="show URLs, health and pids of the local services")
    _add_stack_options(sp)
    sp.add_argument("--json", action="store_true", help="print {service: {url, healthy, pid}} as JSON")
    sp = sub.add_parser("login", help="print the URL and login of each UI of the local stack (MLflow, Prefect)",
                        description="Print, for the local user, the URL and login of the stack's MLflow UI (user, "
                                    "password) and Prefect UI (auth string), read from its secrets folder.")
    _add_stack_options(sp)
    sp.add_argument("--json", action="store_true", help="print {ui: {url, ...login}} as JSON")


def _config_command(sub, name: str, summary: str, description: str, example: str, override_example: str):
    """A subcommand taking a pipeline CONFIG and --set overrides."""
    sp = sub.add_parser(name, help=summary, description=description, epilog=f"example:\n  {example}",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("config", metavar="CONFIG", help="pipeline config (YAML)")
    _add_overrides(sp, override_example)
    return sp


def _add_run_outputs(sp) -> None:
    """The options of a command that runs a flow: where its summary goes, and its run name."""
    sp.add_argument("--summary", metavar="PATH", help="also write the run's JSON summary to PATH")
    sp.add_argument("--run-name", metavar="NAME", help="run name (default: <config name>-<timestamp>)")


def _add_pipeline_commands(sub) -> None:
    sp = _config_command(sub, "run", "run the pipeline on CONFIG against the local stack",
                         "Validate CONFIG, bring the stack up, run the pretrain flow and print links to the Prefect "
                         "flow run, the MLflow runs, the served model and the lineage log.",
                         "crucible run configs/tiny.yaml --set train.max_steps=50 --summary out.json",
                         "train.max_steps=50")
    _add_run_outputs(sp)
    sp.add_argument("--continue", dest="cycle", action="store_true",
                    help="run one continued-pretraining cycle now (the continue-pretraining flow: new files "
                         "only, from the champion) instead of the pretrain flow")

    sp = _config_command(sub, "curate", "curate only: ingest → curate → quality on CONFIG against the local stack",
                         "Validate CONFIG, bring the stack up and run the curation flow alone (the pretrain flow's "
                         "curate subflow: ingest, filter and dedup, quality), for curating without training. Its "
                         "summary has the same per-stage counts and timings as `crucible run`'s.",
                         "crucible curate configs/tiny.yaml --set curate.dedup.substring.enabled=true --summary out.json",
                         "curate.shard_docs=5000")
    _add_run_outputs(sp)

    sp = _config_command(sub, "schedule", "show or change the continue-pretraining schedule",
                         "Read or change the cron schedule of the continue-pretraining deployment that `crucible up "
                         "--config CONFIG` serves (continue.schedule), or pause/resume it.",
                         "crucible schedule configs/continue.yaml --cron '0 3 * * *'", "continue.timezone=Europe/Berlin")
    how = sp.add_mutually_exclusive_group()
    how.add_argument("--cron", metavar="EXPR", help="new cron expression (in continue.timezone)")
    how.add_argument("--pause", action="store_true", help="pause the schedule (no cycle starts until --resume)")
    how.add_argument("--resume", action="store_true", help="resume a paused schedule")

    sp = sub.add_parser("ablate", help="train the same model on the langid-only and the curated corpus; compare "
                                       "held-out loss",
                        description="Validate CONFIG, bring the stack up and run the ablate flow: the same model and "
                                    "token budget on (a) extracted text after language ID only and (b) the fully "
                                    "curated corpus, both scored on WikiText-2 validation (ablate.eval_path).")
    sp.add_argument("config", metavar="CONFIG", help="pipeline config (YAML)")
    _add_overrides(sp, "train.max_steps=50")
    sp.add_argument("--out", metavar="PATH", help="also write the JSON result to PATH")


def _add_lineage_command(sub) -> None:
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
    _add_stack_options(rp)


def _add_tools(sub, mounted: set[str]) -> None:
    """The document tools are listed in --help; a tool's options (and imports) are mounted only
    when it is the command being run."""
    for name, module, help_ in TOOLS:
        tp = sub.add_parser(name, help=help_, description=help_)
        if name in mounted:
            __import__(module, fromlist=["add_arguments"]).add_arguments(tp)


def _add_plan_command(sub, mounted: bool) -> None:
    if not mounted:  # listed in --help; its options are mounted only when it runs (import time)
        sub.add_parser("plan", help=PLAN_HELP)
        return
    from infra.cli import plan as plan_cli

    sp = sub.add_parser("plan", help=PLAN_HELP, description=plan_cli.__doc__.split("\n\n")[0],
                        epilog="examples:\n" + plan_cli.__doc__.split("\n\n")[1].replace("    plan ", "  crucible plan "),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    plan_cli.add_arguments(sp)


def build_parser(with_plan: bool = True, argv_commands: set[str] | None = None) -> argparse.ArgumentParser:
    """The `crucible` parser. `with_plan` / `argv_commands`: which lazily mounted commands (plan,
    filter, dedup) get their full options, i.e. the ones on the command line."""
    p = argparse.ArgumentParser(
        prog="crucible",
        description="Crucible: an open, auditable pipeline for pre-training language models.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-dir", metavar="DIR",
                   help="stack state directory (databases, logs, pid files); overrides stack.state_dir "
                        "and $CRUCIBLE_STATE_DIR")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_stack_commands(sub)
    _add_pipeline_commands(sub)
    _add_lineage_command(sub)
    _add_tools(sub, argv_commands or set())
    _add_plan_command(sub, with_plan)
    return p


def cmd_tool(args) -> int:
    module = dict((n, m) for n, m, _ in TOOLS)[args.command]
    return __import__(module, fromlist=["run"]).run(args)


def cmd_plan(args) -> int:
    from infra.cli import plan as plan_cli

    return plan_cli.run(args)


COMMANDS = {"up": commands.cmd_up, "down": commands.cmd_down, "status": commands.cmd_status, "login": commands.cmd_login,
            "run": commands.cmd_run, "curate": commands.cmd_curate, "schedule": commands.cmd_schedule, "ablate": commands.cmd_ablate, "lineage": commands.cmd_lineage,
            "plan": cmd_plan, "filter": cmd_tool, "dedup": cmd_tool}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    with_plan = "plan" in argv
    if with_plan:  # `--params -7e9` -> `--params=-7e9`, so the planner reports the bad value
        from infra.cli.plan import join_negative_values

        argv = join_negative_values(argv)
    args = build_parser(with_plan, {a for a in argv if a in ("filter", "dedup")}).parse_args(argv)
    if args.state_dir:
        os.environ[STATE_DIR_ENV] = str(Path(args.state_dir).expanduser().resolve())
    from tasks.config import ConfigError

    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        return commands.fail(str(e), 2)
    except KeyboardInterrupt:
        return commands.fail("interrupted", 130)
    except StackError as e:  # a CLI prints one line, not a traceback, for known failures
        return commands.fail(f"crucible: {e}", 1)
