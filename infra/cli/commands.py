"""The commands of `crucible` that drive the local stack and the pipeline: up, down, status, login, run,
curate, ablate and lineage replay. Each takes the parsed arguments and returns the exit status."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from infra import stack
from tasks.core.constants import MLFLOW_USERNAME, REPO_ROOT
from tasks.core.signing import SIGNING_KEY_FILE_ENV
from tasks.core.storage import local_run_root, store_for
from tasks.tracking.links import mlflow_run_page

DEFAULT_CONFIG = "configs/tiny.yaml"


def fail(msg: str, code: int = 2) -> int:
    print(msg, file=sys.stderr)
    return code


def _load(path: str, overrides: list[str]):
    from infra.settings import load_config

    cfg = load_config(path, overrides)
    _use_stack_key(cfg.stack)
    return cfg


def _use_stack_key(stack_cfg) -> None:
    """What a command signs or verifies in this process (the service records `stack.up` checks before
    it starts anything, run roots, a replayed lineage log) uses the stack's key, wherever its state dir
    is, not one found relative to the working directory: `run` in a fresh shell must verify what `up`
    signed, or it refuses the running services' records and starts them again."""
    os.environ[SIGNING_KEY_FILE_ENV] = str(stack.signing_key_path(stack_cfg))


def _stack_configs(args):
    if getattr(args, "ray", False):  # `crucible up --ray`
        args.overrides = [*args.overrides, "stack.ray=cluster"]
    return _stack_sections(args)


def _config_path(args) -> str | None:
    """--config, else the default configs/tiny.yaml (looked up in the working directory, then in the
    repository), else None."""
    if args.config is not None:
        return args.config
    for candidate in (Path(DEFAULT_CONFIG), REPO_ROOT / DEFAULT_CONFIG):
        if candidate.is_file():
            return str(candidate)
    return None


def _stack_sections(args):
    """(stack, deploy, lineage sections) from the config (_config_path); the defaults if there is none."""
    from infra.settings import LineageConfig, StackConfig
    from tasks.config import DeployConfig, apply_overrides

    path = _config_path(args)
    if path is not None:
        cfg = _load(path, args.overrides)
        sections = cfg.stack, cfg.deploy, cfg.lineage
    else:
        raw = apply_overrides({}, args.overrides)
        sections = (StackConfig.model_validate(raw.get("stack", {})), DeployConfig.model_validate(raw.get("deploy", {})),
                    LineageConfig.model_validate(raw.get("lineage", {})))
        _use_stack_key(sections[0])  # (_load does it for a config)
    return sections


def _print_status(st: dict) -> None:
    for name, s in st.items():
        if not isinstance(s, dict):
            continue
        state = "healthy" if s.get("healthy") else ("running, not healthy" if s.get("pid") else "stopped")
        pid = f"pid {s['pid']}" if s.get("pid") else ""
        print(f"  {name:<13} {state:<21} {s.get('url') or '':<32} {pid}".rstrip())
        if s.get("error"):
            print(f"  {'':<13} {s['error']}")
        if s.get("nodes"):  # the Ray head: nodes alive, and the address a run attaches to
            print(f"  {'':<13} {s['nodes']}; ray.address={s.get('address')}")


def cmd_up(args) -> int:
    stack_cfg, _, lineage_cfg = _stack_configs(args)
    path = _config_path(args)  # the pretrain deployment's config (and continue-pretraining's, if scheduled)
    print(f"starting the local stack in {stack.state_dir(stack_cfg)} ...", file=sys.stderr)
    res = stack.up(stack_cfg, lineage_cfg=lineage_cfg, pipeline=None if path is None else (path, args.overrides))
    if path is not None:  # the checkpoints of its deployments' runs are evaluated by the triggered flows
        _register_run_root(stack_cfg, _load(path, args.overrides))
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        _print_status(res)
        print(f"ready in {res['seconds']:.1f}s; logs in {stack.state_dir(stack_cfg) / 'logs'}")
        print(f"UI logins: {login_hint(stack_cfg)}")
    return 0


def cmd_down(args) -> int:
    stack_cfg, _, _ = _stack_configs(args)
    for name, what in stack.down(stack_cfg).items():
        print(f"  {name:<13} {what}")
    return 0


def cmd_status(args) -> int:
    stack_cfg, _, lineage_cfg = _stack_configs(args)
    st = stack.status(stack_cfg, lineage_cfg)
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print(f"state dir: {stack.state_dir(stack_cfg)}")
        _print_status(st)
    return 0 if all(s["healthy"] for s in st.values()) else 1


def login_files(stack_cfg) -> dict[str, Path]:
    """Where each UI's login lives: the stack's 0600 secret files."""
    return {"mlflow": stack.mlflow_password_path(stack_cfg),
            "prefect": stack.state_dir(stack_cfg) / "secrets" / stack.PREFECT_AUTH}


def login_hint(stack_cfg) -> str:
    """How to log in to the UIs the printed links open (where the credentials live, never their values)."""
    files = login_files(stack_cfg)
    return (f"once per browser; `crucible login` prints both logins (Prefect: crucible:<content of "
            f"{files['prefect']}>; MLflow: user {MLFLOW_USERNAME}, password in {files['mlflow']})")


def cmd_login(args) -> int:
    """The URL and login of each UI of the stack, read from its secrets folder: for the local user's
    browser (the secrets are 0600 files of whoever started the stack; nothing is logged)."""
    stack_cfg, _, _ = _stack_configs(args)
    files = login_files(stack_cfg)
    # read, never generated here: a password no server holds would be printed as the login
    logins = {}
    if files["mlflow"].is_file():
        logins["mlflow"] = {"url": stack.mlflow_tracking_uri(stack_cfg), "user": MLFLOW_USERNAME,
                            "password": files["mlflow"].read_text().strip(), "file": str(files["mlflow"])}
    if files["prefect"].is_file():
        # Prefect's UI asks for the whole auth string (server.api.auth_string) on its login page
        logins["prefect"] = {"url": f"{stack.prefect_ui_url(stack_cfg)}/login",
                             "auth_string": stack.secret(stack_cfg, stack.PREFECT_AUTH), "file": str(files["prefect"])}
    if not logins:
        return fail(f"crucible: no stack has been started in {stack.state_dir(stack_cfg)} (crucible up)", 1)
    if args.json:
        print(json.dumps(logins, indent=2))
        return 0
    for name, login in logins.items():
        print(f"  {name:<8} {login['url']}  " + "  ".join(f"{k} {v}" for k, v in login.items() if k not in ("url", "file")))
    print("MLflow asks in the browser's login dialog; Prefect on its login page (the auth string is the whole "
          "password). Read from " + ", ".join(login["file"] for login in logins.values()))
    return 0


def _stack_for(cfg) -> None:
    """Bring the local stack up for a pipeline config and point this process's clients at it."""
    res = stack.up(cfg.stack, lineage_cfg=cfg.lineage)
    _print_status({k: v for k, v in res.items() if isinstance(v, dict)})
    stack.use_stack(cfg.stack, cfg.lineage)
    _attach_stack_ray(cfg)
    _register_run_root(cfg.stack, cfg)


def _register_run_root(stack_cfg, cfg) -> None:
    """The triggered flows load checkpoints from the registered run roots only (and, for an
    object-store run_root, from its store)."""
    stack.register_run_root(stack_cfg, local_run_root(cfg))
    if (store := store_for(cfg)) is not None:
        stack.register_run_store(stack_cfg, store)


def _attach_stack_ray(cfg) -> None:
    """While the stack's Ray cluster is up (`crucible up --ray`) a run without its own ray.address
    uses it: the address goes into the config (so MLflow and the run's config.json record it),
    the cluster's token into this process's environment."""
    own = cfg.ray.address
    os.environ.update(stack.attach_cluster(cfg))
    if cfg.ray.address != own:
        print(f"using the stack's Ray cluster: ray.address={cfg.ray.address}", file=sys.stderr)


def _checked_on_stack(args):
    """The validated config with its Ray address and stores checked, the stack up: (cfg, None);
    else (None, exit status)."""
    cfg = _load(args.config, args.overrides)  # ConfigError → exit 2 before anything heavy is imported
    if cfg.ray.address and cfg.stack.ray != "cluster":  # (a cluster of the stack's own is started below)
        from tasks.core.ray_utils import RayUnreachable, check_ray_address

        try:
            check_ray_address(cfg.ray)
        except RayUnreachable as e:
            return None, fail(f"crucible: {e}", 1)
    from tasks.core.storage import StorageError
    from tasks.dedup.index import check_index_store

    try:  # an object-store run_root that is missing or refuses the key: before the stack starts
        store_for(cfg, check=True)
        check_index_store(cfg)
    except StorageError as e:
        return None, fail(f"crucible: {e}", 1)
    print(f"config {args.config} is valid; bringing up the local stack in {stack.state_dir(cfg.stack)} ...",
          file=sys.stderr)
    _stack_for(cfg)
    return cfg, None


def cmd_run(args) -> int:
    cfg, code = _checked_on_stack(args)
    if cfg is None:
        return code
    if args.cycle:
        from flows.continued import run_cycle as run_pipeline  # imports Prefect, which reads PREFECT_API_URL now
    else:
        from flows.pretrain import run_pipeline

    t0 = time.monotonic()
    try:
        summary = run_pipeline(cfg, summary_path=args.summary, run_name=args.run_name)
        if summary.get("status") == "NO_NEW_DATA":
            print(f"crucible: {summary['message']}; nothing was trained")
            return 0
    except Exception as e:  # noqa: BLE001 - the flow's own logs hold the traceback
        where = f"; summary in {args.summary}" if args.summary else ""
        return fail(f"crucible: pipeline failed after {time.monotonic() - t0:.0f}s: {e}{where}", 1)
    _print_links(summary, time.monotonic() - t0, cfg.stack)
    return 0 if summary.get("status", "COMPLETED") == "COMPLETED" else 1


def cmd_curate(args) -> int:
    """The curation flow alone (ingest → curate → quality) on the stack, like `run`."""
    cfg, code = _checked_on_stack(args)
    if cfg is None:
        return code
    from flows.curation import run_curation  # imports Prefect, which reads PREFECT_API_URL now

    t0 = time.monotonic()
    try:
        summary = run_curation(cfg, summary_path=args.summary, run_name=args.run_name)
    except Exception as e:  # noqa: BLE001 - the flow's own logs hold the traceback
        where = f"; summary in {args.summary}" if args.summary else ""
        return fail(f"crucible: curation failed after {time.monotonic() - t0:.0f}s: {e}{where}", 1)
    stages = summary.get("stages") or {}
    print(f"\ncuration {summary.get('run_name', '')} {summary.get('status', '')} in {time.monotonic() - t0:.0f}s")
    for name in ("ingest", "curate", "quality"):
        s = stages.get(name) or {}
        print(f"  {name:<16} : {s.get('docs_in')} documents in, {s.get('docs_out')} out, "
              f"{(summary.get('timings_s') or {}).get(name, 0):.1f}s")
    print(f"  Curated shards   : {len((stages.get('quality') or {}).get('shards') or [])}")
    print(f"  Prefect flow run : {summary.get('prefect_ui_url')}")
    print(f"  Lineage log      : {summary.get('lineage_log')}")
    print(f"  Run directory    : {summary.get('run_dir')}")
    print(f"  Log in           : {login_hint(cfg.stack)}")
    return 0 if summary.get("status", "COMPLETED") == "COMPLETED" else 1


def cmd_schedule(args) -> int:
    """Show or change the continue-pretraining deployment's schedule on the running stack."""
    # a bad --cron fails here, named like any config field (a JSON string is valid YAML)
    cfg = _load(args.config, args.overrides + ([f"continue.schedule={json.dumps(args.cron)}"] if args.cron else []))
    stack.use_stack(cfg.stack, cfg.lineage)
    from flows.continued import set_schedule

    try:
        result = set_schedule(cfg, cron=args.cron, paused=True if args.pause else False if args.resume else None)
    except Exception as e:  # noqa: BLE001 - e.g. the deployment is not registered: say how to register it
        return fail(f"crucible: could not read the continue-pretraining deployment ({type(e).__name__}: {e}); "
                    f"register it with `crucible up --config {args.config}` (continue.schedule set)", 1)
    print(json.dumps(result, indent=2))
    return 0


def cmd_ablate(args) -> int:
    cfg = _load(args.config, args.overrides)
    _stack_for(cfg)
    from flows.ablate import run_ablation_flow

    result = run_ablation_flow(cfg, args.out)
    losses = result["heldout_loss"]
    print(f"\nablation {result['run_name']}: held-out loss langid-only {losses['langid_only']:.4f}, "
          f"curated {losses['curated']:.4f} ({100 * result['relative_improvement']:+.2f} %)")
    print(f"  Result           : {Path(result['run_dir']) / 'ablate' / 'ablation.json'}")
    return 0


def _print_links(summary: dict, seconds: float, stack_cfg) -> None:
    mlflow = summary.get("mlflow") or {}
    deploy = (summary.get("stages") or {}).get("deploy") or {}
    print(f"\npipeline {summary.get('run_name', '')} {summary.get('status', '')} in {seconds:.0f}s")
    print(f"  Prefect flow run : {summary.get('prefect_ui_url')}")
    print(f"  MLflow run       : {mlflow.get('run_url') or mlflow.get('tracking_uri')}  (experiment "
          f"{mlflow.get('experiment')}, run {mlflow.get('run_id')})")
    train = mlflow_run_page(mlflow.get("tracking_uri") or "", mlflow.get("experiment_id"),
                            ((summary.get("stages") or {}).get("train") or {}).get("mlflow_run_id"))
    if train:
        print(f"  MLflow train run : {train}  (its datasets: the token shards it trained on)")
    if deploy.get("version") is not None:
        print(f"  Registered model : {deploy.get('model_name')} version {deploy.get('version')} (alias champion)")
    elif deploy.get("reason"):
        print(f"  Deployment gate  : not deployed: {deploy['reason']}")
    print(f"  Served model     : {deploy.get('endpoint')}")
    if deploy.get("endpoint"):  # an API, not a page: say which key it asks for
        from infra.services.model_server.supervisor import CLIENT_KEY_FILE

        print(f"  Model API key    : {stack.state_dir(stack_cfg) / 'secrets' / CLIENT_KEY_FILE} (bearer token; "
              f"deploy.api_key_env names your own instead)")
    print(f"  Lineage log      : {summary.get('lineage_log')}")
    _print_lineage_links(summary)
    print(f"  Run directory    : {summary.get('run_dir')}")
    print(f"  Log in           : {login_hint(stack_cfg)}")


def _print_lineage_links(summary: dict) -> None:
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


def cmd_lineage(args) -> int:
    _, _, lineage_cfg = _stack_configs(args)
    url = args.url or stack.lineage_url(lineage_cfg)
    from tasks.lineage.replay import ReplayError, replay

    import httpx

    batch = args.batch_size or lineage_cfg.replay_batch_size
    # the stack's own service takes the stack's write token; another endpoint whatever the environment holds
    stack_cfg = _stack_configs(args)[0]
    token = stack.secret(stack_cfg, stack.LINEAGE_WRITE_TOKEN) if not args.url else None
    code = 0
    for path in args.logs:
        try:
            result = replay(path, url, batch_size=batch, single=args.single, token=token)
        except (ReplayError, ValueError, OSError, httpx.HTTPError) as e:
            hint = "" if args.url else " (is the stack up? `crucible up`)"
            print(f"crucible: replay of {path} to {url} failed: {e}{hint}", file=sys.stderr)
            code = 1
            continue
        print(json.dumps({"file": path, **result}))
    return code
