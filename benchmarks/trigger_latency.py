"""Time from `crucible.checkpoint.saved` to evaluation results in MLflow and to a served champion,
through a real local stack; print the figures and write benchmarks/results/trigger_latency.json.

    .venv/bin/python benchmarks/trigger_latency.py [--keep]

What runs: `crucible up` on free loopback ports (infra.stack.up: Prefect server, MLflow server,
lineage service, and the worker of the stack's work pool running the evaluate-checkpoint and
deploy-model deployments), with configs/tiny.yaml's evaluation suite, gate and model-server settings. A run
directory is laid out as the pipeline lays it out (config.json, tokenizer, token shards from real
text in shared/data/text, built by tests/lm_helpers), and two real checkpoints of the tiny model
(tasks.train's checkpoint code) are saved one after the other: A after 10 AdamW steps, B after 40
(lower loss, so it passes "better than the champion"). For each, the benchmark emits the event
exactly as the pipeline's training worker does (flows.train_worker.PrefectEvents) and measures from
the emit:
    eval_in_mlflow_s   until val_loss at the checkpoint's step is in the training run (MLflow server)
    champion_s         until the registry's `champion` alias points at the checkpoint
    served_s           until the model server's /health reports the checkpoint's step and
                       /v1/models lists the model
and, from the Prefect flow runs: dispatch_s (event -> evaluate-checkpoint run started),
evaluate_run_s, deploy_dispatch_s (evaluate run end -> deploy-model run started), deploy_run_s.
A is the cold path (first champion: the model server process is started); B the warm one (the
new champion is swapped into the running server). Nothing here is compared with a peer: no
other tool in this workplace triggers evaluation from checkpoint events.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # lm_helpers: the tokenizer / token shards the LM tests use

from _common import write_result  # noqa: E402
from tasks.core.constants import DEPLOY_DEPLOYMENT, EVAL_DEPLOYMENT  # noqa: E402
from tasks.core.layout import RunLayout  # noqa: E402
from tasks.core.net import free_port  # noqa: E402

RUN = "latency-run"


def _train_checkpoints(cfg, layout: RunLayout, steps: tuple[int, ...]) -> list[Path]:
    """Train the tiny model on the run's train split; save a checkpoint at each of `steps`."""
    import numpy as np
    import torch

    from tasks.core.hashing import sha256_file
    from tasks.tokens.binfile import load_index, open_split
    from tasks.train.checkpoint import apply_retention, save_checkpoint
    from tasks.train.model import GPT, GPTConfig

    index = load_index(layout.tokens_index)
    train = open_split(layout.tokens_index, "train")
    mcfg = GPTConfig.from_model_config(cfg.model, index["vocab_size"])
    torch.manual_seed(0)
    model = GPT(mcfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    meta = {"model": mcfg.to_dict(), "eos_id": index["eos_id"], "run_name": RUN,
            "tokenizer_sha256": sha256_file(layout.tokenizer_file)}
    out, T = [], mcfg.seq_len
    for step in range(1, max(steps) + 1):
        starts = rng.integers(0, len(train) - T - 1, size=8)
        w = torch.from_numpy(np.stack([np.asarray(train[s:s + T + 1], dtype=np.int64) for s in starts]))
        _, loss = model(w[:, :-1], w[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step in steps:
            out.append(save_checkpoint(model, opt, step, layout.stage_dir("train"), {**meta, "step": step}))
            apply_retention(layout.stage_dir("train"), out[-1], None)  # the run's manifest, as the trainer writes
    return out


def _layout_run(cfg, base: Path) -> RunLayout:
    from lm_helpers import tokenizer_artifact, tokens_artifact

    tok, tokens = tokenizer_artifact(base), tokens_artifact(base)
    layout = RunLayout.for_run(cfg.run_root, RUN)
    layout.tokenizer_file.parent.mkdir(parents=True)
    shutil.copy(tok["path"], layout.tokenizer_file)
    shutil.copytree(Path(tokens["index_path"]).parent, layout.tokens_index.parent)
    layout.config_file.write_text(cfg.model_dump_json(indent=2))
    return layout


def _flow_runs(api: str, deployment: str, checkpoint: Path) -> list[dict]:
    """The runs of `deployment` ("<flow>/<deployment>") for `checkpoint`."""
    import httpx

    name = deployment.split("/", 1)[1]
    from tasks.core.net import prefect_api_headers

    runs = httpx.post(f"{api}/flow_runs/filter", timeout=30, trust_env=False, headers=prefect_api_headers(),
                      json={"deployments": {"name": {"any_": [name]}}}).json()
    return [r for r in runs if r["parameters"].get("checkpoint") == str(checkpoint)]


def _ts(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() if iso else None


def measure(cfg, api: str, mlflow_uri: str, run_id: str, ckpt: Path, step: int, timeout: float) -> dict:
    import httpx
    from mlflow import MlflowClient

    from flows.train_worker import PrefectEvents
    from infra.services.model_server.supervisor import client_headers

    client = MlflowClient(tracking_uri=mlflow_uri, registry_uri=mlflow_uri)
    base = f"http://127.0.0.1:{cfg.deploy.port}"
    headers = client_headers(cfg.stack, cfg.deploy)  # the stack's server wants its clients' key
    got: dict[str, float] = {}
    t_emit = time.time()
    t0 = time.perf_counter()
    events = PrefectEvents()
    events.checkpoint_saved(ckpt, step, run_id, RUN)
    events.drain()
    while len(got) < 3:
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"step {step}: only {sorted(got)} after {timeout:.0f}s")
        now = time.perf_counter() - t0
        if "eval_in_mlflow_s" not in got and any(m.step == step for m in client.get_metric_history(run_id, "val_loss")):
            got["eval_in_mlflow_s"] = now
        if "champion_s" not in got:
            try:
                if client.get_model_version_by_alias(cfg.deploy.model_name, "champion").tags.get("checkpoint") == str(ckpt.resolve()):
                    got["champion_s"] = now
            except Exception:  # noqa: BLE001 - no champion yet
                pass
        if "served_s" not in got:
            try:
                health = httpx.get(f"{base}/health", timeout=2, trust_env=False).json()
                models = httpx.get(f"{base}/v1/models", timeout=2, trust_env=False, headers=headers).json()
                if health.get("step") == step and any(m["id"] == cfg.deploy.model_name for m in models["data"]):
                    got["served_s"] = now
            except (httpx.HTTPError, ValueError, KeyError):
                pass
        time.sleep(0.25)
    out = {"step": step, "checkpoint": ckpt.name, **{k: round(v, 2) for k, v in got.items()}}
    ev = _flow_runs(api, EVAL_DEPLOYMENT, ckpt)
    dep = _flow_runs(api, DEPLOY_DEPLOYMENT, ckpt)
    if ev:
        s, e = _ts(ev[0]["start_time"]), _ts(ev[0]["end_time"])
        out.update(dispatch_s=round(s - t_emit, 2), evaluate_run_s=round(e - s, 2))
        if dep and dep[0]["start_time"]:
            ds, de = _ts(dep[0]["start_time"]), _ts(dep[0]["end_time"])
            out.update(deploy_dispatch_s=round(ds - e, 2), deploy_run_s=round(de - ds, 2) if de else None)
    report = json.loads(RunLayout.of_checkpoint(ckpt).triggered_eval_report(ckpt).read_text())
    out.update(val_loss=report["val_loss"], eval_seconds_in_report=report.get("seconds"), gate=report["gate"]["reason"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per checkpoint")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, run dir)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "trigger_latency.json"))
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="crucible-trigger-latency-"))
    for k in [k for k in os.environ if k.startswith(("PREFECT_", "MLFLOW_"))]:
        del os.environ[k]
    from infra import stack
    from infra.settings import load_config

    cfg = load_config(args.config, [
        f"run_root={tmp / 'runs'}", f"stack.state_dir={tmp / 'state'}", f"stack.prefect_port={free_port()}",
        f"stack.mlflow_port={free_port()}", f"stack.worker_port={free_port()}",
        f"lineage.service_port={free_port()}", f"deploy.port={free_port()}", "deploy.model_name=latency-model"])
    os.environ.pop(stack.STATE_DIR_ENV, None)
    stack.use_stack(cfg.stack, cfg.lineage)  # before Prefect is imported anywhere (with the stack's auth)
    layout = _layout_run(cfg, tmp / "lm")
    stack.register_run_root(cfg.stack, cfg.run_root)  # as `crucible run` does: the triggered flows load from there
    stack.register_run_config(cfg.stack, layout.run_dir, cfg.model_dump(mode="json"))  # as its pretrain flow does
    ckpts = _train_checkpoints(cfg, layout, (10, 40))
    t0 = time.perf_counter()
    results: list[dict] = []
    try:
        up = stack.up(cfg.stack, lineage_cfg=cfg.lineage)
        stack_s = time.perf_counter() - t0
        print(f"stack up in {stack_s:.1f}s: " + ", ".join(f"{k} {v['url']}" for k, v in up.items() if isinstance(v, dict)))
        api, mlflow_uri = stack.prefect_api_url(cfg.stack), stack.mlflow_tracking_uri(cfg.stack)
        _wait_automations(api)
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=mlflow_uri)
        run_id = client.create_run(client.create_experiment("trigger-latency")).info.run_id
        for ckpt, step in zip(ckpts, (10, 40)):
            r = measure(cfg, api, mlflow_uri, run_id, ckpt, step, args.timeout)
            results.append(r)
            print(f"step {step}: eval in MLflow {r['eval_in_mlflow_s']:.1f}s, champion {r['champion_s']:.1f}s, "
                  f"served {r['served_s']:.1f}s (dispatch {r.get('dispatch_s')}s, evaluate run "
                  f"{r.get('evaluate_run_s')}s, deploy dispatch {r.get('deploy_dispatch_s')}s, deploy run "
                  f"{r.get('deploy_run_s')}s; val_loss {r['val_loss']})")
    finally:
        stack.down(cfg.stack)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")
    result = {
        "benchmark": "trigger_latency", "when": datetime.now().isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "config": {"file": str(Path(args.config).relative_to(REPO)) if Path(args.config).is_relative_to(REPO) else args.config,
                   "model": cfg.model.model_dump(), "evaluate": {k: v for k, v in cfg.evaluate.model_dump().items()
                                                               if isinstance(v, dict) and "enabled" in v},
                   "deploy": {"max_val_loss": cfg.deploy.max_val_loss, "min_improvement": cfg.deploy.min_improvement,
                              "reload_in_place": cfg.deploy.reload_in_place}},
        "stack_up_s": round(stack_s, 1),
        "checkpoints": results,
        "notes": "A = cold (first champion, model server started), B = warm (hot swap into the running server). "
                 "Tokenizer/token shards from tests/lm_helpers (vocab 512, real text); eval suite as configured.",
    }
    write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0


def _wait_automations(api: str, timeout: float = 120.0) -> None:
    """`up` registers the deployments' automations; the server loads them a moment later."""
    import httpx

    from tasks.core.net import prefect_api_headers

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        autos = httpx.post(f"{api}/automations/filter", json={}, timeout=30, trust_env=False,
                           headers=prefect_api_headers()).json()
        if len([a for a in autos if a.get("enabled")]) >= 2:
            time.sleep(3)  # the server's trigger service loads new automations periodically
            return
        time.sleep(1)
    raise TimeoutError("no automations of the triggered deployments were registered")


if __name__ == "__main__":
    sys.exit(main())
