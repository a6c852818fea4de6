"""The `crucible` command line: fast failure on bad configs, help with examples, status."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tasks.core.net import free_port

REPO = Path(__file__).resolve().parent.parent
CRUCIBLE = [sys.executable, "-m", "infra.cli"]
TINY = str(REPO / "configs" / "tiny.yaml")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "CRUCIBLE_"))}
    return {**env, **extra}


def _crucible(*args: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CRUCIBLE, *args], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout, **kw)


def test_bad_config_value_fails_fast_and_names_the_field(tmp_path):
    # "fast" = before any service, Ray or Prefect starts (the state dir stays absent); no wall-clock
    # bound here: timings belong to benchmarks/, and this machine's load varies
    r = _crucible("--state-dir", str(tmp_path / "state"), "run", TINY, "--set", "train.max_steps=-1")
    assert r.returncode == 2, r.stderr
    assert "train.max_steps" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "state").exists(), "nothing may start before the config validates"


def test_console_script_fails_fast_too(tmp_path):
    script = Path(sys.executable).parent / "crucible"
    assert script.exists(), "the `crucible` console script is not installed (pip install -e .)"
    r = subprocess.run([str(script), "run", TINY, "--set", "model.n_head=3"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "model" in r.stderr and "divisible" in r.stderr


def test_missing_config_and_bad_override_syntax(tmp_path):
    r = _crucible("run", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "config file not found" in r.stderr
    r = _crucible("run", TINY, "--set", "train.max_steps")
    assert r.returncode == 2 and "KEY=VALUE" in r.stderr


def test_help_shows_examples():
    r = _crucible("--help")
    assert r.returncode == 0
    for example in ("crucible up", "crucible down", "crucible status --json", "crucible run configs/tiny.yaml",
                    "--set train.max_steps=", "--summary", "crucible lineage replay", "--url http://",
                    "crucible plan --params 7e9"):
        assert example in r.stdout, example
    r = _crucible("run", "--help")
    assert r.returncode == 0 and "--summary" in r.stdout and "--set" in r.stdout
    r = _crucible("lineage", "replay", "--help")
    assert r.returncode == 0 and "--url" in r.stdout and "Marquez" in r.stdout
    r = _crucible("plan", "--help")
    assert r.returncode == 0 and "--params" in r.stdout and "crucible plan --flops 1e22" in r.stdout


def test_status_json_of_a_stopped_stack(tmp_path):
    p_port, m_port, l_port = free_port(), free_port(), free_port()
    r = _crucible("--state-dir", str(tmp_path / "state"), "status", "--json", "--config", TINY,
                  "--set", f"stack.prefect_port={p_port}", "--set", f"stack.mlflow_port={m_port}",
                  "--set", f"lineage.service_port={l_port}")
    assert r.returncode == 1, r.stderr  # not healthy
    assert json.loads(r.stdout) == {
        "prefect": {"url": f"http://127.0.0.1:{p_port}", "healthy": False, "pid": None},
        "mlflow": {"url": f"http://127.0.0.1:{m_port}", "healthy": False, "pid": None},
        "lineage": {"url": f"http://127.0.0.1:{l_port}", "healthy": False, "pid": None},
        # the worker's page in Prefect's UI, through its login (a deep link fails before it)
        "worker": {"url": f"http://127.0.0.1:{p_port}/login?redirect=/work-pools/work-pool/crucible", "healthy": False,
                   "pid": None},
    }
    r = _crucible("--state-dir", str(tmp_path / "state"), "down", "--config", TINY)
    assert r.returncode == 0 and "not running" in r.stdout


def test_state_dir_from_env_overrides_config(tmp_path, monkeypatch):
    from infra import stack
    from infra.settings import StackConfig

    cfg = StackConfig(state_dir="relative-state")
    monkeypatch.delenv(stack.STATE_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert stack.state_dir(cfg) == (tmp_path / "relative-state").resolve()
    monkeypatch.setenv(stack.STATE_DIR_ENV, str(tmp_path / "from-env"))
    assert stack.state_dir(cfg) == (tmp_path / "from-env").resolve()
    assert stack.client_env(cfg)[stack.STATE_DIR_ENV] == str((tmp_path / "from-env").resolve())
    # the lineage service's database lives in the state directory unless given as an absolute path
    from infra.settings import LineageConfig

    assert stack.lineage_db(cfg) == (tmp_path / "from-env" / "lineage.db").resolve()
    assert stack.lineage_db(cfg, LineageConfig(service_db=str(tmp_path / "x.db"))) == tmp_path / "x.db"
    assert stack.client_env(cfg, LineageConfig(service_port=5999))[stack.LINEAGE_URL_ENV] == "http://127.0.0.1:5999"


def test_cli_commands_sign_with_the_key_of_the_stacks_state_dir(tmp_path, monkeypatch):
    """`crucible up --config` registers run roots and `crucible lineage replay` verifies lines in the
    CLI's own process: with the key of the stack's state dir (stack.state_dir, from the config), not
    one under the working directory the triggered flows would never accept."""
    import argparse

    from infra.cli.commands import _stack_configs
    from tasks.core.signing import SIGNING_KEY_FILE_ENV, key_path

    monkeypatch.delenv(SIGNING_KEY_FILE_ENV)
    monkeypatch.delenv("CRUCIBLE_STATE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(config=None, overrides=[f"stack.state_dir={tmp_path / 'state'}"])
    _stack_configs(args)
    assert key_path() == (tmp_path / "state" / "secrets" / "signing.key").resolve()
    assert not (tmp_path / ".crucible").exists()


def test_run_verifies_the_records_up_signed_and_refuses_another_keys(tmp_path, monkeypatch):
    """`crucible up` signs the stack's service records (run/<svc>.json) with the key of its state dir
    (here stack.state_dir from the config). A later `crucible run` process from a plain shell, same
    config, checks the pid files in `stack.up`: it must verify them with that key (else it refuses
    the running services' records and starts them again), and still refuse one signed with another key."""
    import argparse
    from dataclasses import replace

    import pytest

    from infra import stack
    from infra.cli import commands
    from tasks.core.signing import SIGNING_KEY_FILE_ENV, ensure_key_file

    monkeypatch.delenv(SIGNING_KEY_FILE_ENV)
    monkeypatch.delenv(stack.STATE_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    overrides = [f"stack.state_dir={tmp_path / 'state'}"]
    # `crucible up`'s process: its records, for a live process (this one) as the service
    stack_cfg = commands._stack_configs(argparse.Namespace(config=TINY, overrides=overrides, ray=False))[0]
    run = stack.state_dir(stack_cfg) / "run"
    run.mkdir(parents=True)
    genuine = stack.ServiceSpec(name="prefect", cmd=["true"], host="127.0.0.1", port=free_port(), health_path="/",
                                url="http://127.0.0.1/", marker=[stack.process_cmdline(os.getpid()).split()[0]])
    stack.write_spec(stack_cfg, genuine)
    # a record the stack never signed: written with some other key
    monkeypatch.setenv(SIGNING_KEY_FILE_ENV, str(ensure_key_file(tmp_path / "other" / "signing.key")))
    stack.write_spec(stack_cfg, replace(genuine, name="mlflow"))
    for name in ("prefect", "mlflow"):
        (run / f"{name}.pid").write_text(f"{os.getpid()}\n")

    # a later `crucible run` process: no key in its environment; stopped where `up` checks the pid files
    monkeypatch.delenv(SIGNING_KEY_FILE_ENV)
    seen = {}

    class Checked(Exception):
        pass

    def checking_up(cfg, **_):
        seen.update({name: stack.running_pid(cfg, name) for name in ("prefect", "mlflow")})
        raise Checked

    monkeypatch.setattr(stack, "up", checking_up)
    with pytest.raises(Checked):
        commands.cmd_run(argparse.Namespace(config=TINY, overrides=overrides, cycle=False, summary=None,
                                            run_name=None))
    assert seen == {"prefect": os.getpid(), "mlflow": None}
    assert not (tmp_path / ".crucible").exists()  # no key made up under the working directory


def test_plan_subcommand_prints_the_plan_as_json():
    r = _crucible("plan", "--params", "7e9", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["tokens"] == 1.4e11 and plan["params"] == 7e9
    r = _crucible("plan", "--params", "-7e9")  # a negative value is reported as such, exit 2
    assert r.returncode == 2 and "positive" in r.stderr
    r = _crucible("plan")
    assert r.returncode == 2 and "params" in r.stderr


def test_lineage_replay_to_a_stopped_service_fails_with_a_hint(tmp_path, monkeypatch):
    log = tmp_path / "lineage.jsonl"
    log.write_text("")
    r = _crucible("--state-dir", str(tmp_path / "state"), "lineage", "replay", str(log), "--config", TINY,
                  "--set", f"lineage.service_port={free_port()}")
    assert r.returncode == 0 and json.loads(r.stdout)["events"] == 0  # nothing to send: nothing to fail
    from tasks.core.signing import SIGNING_KEY_FILE_ENV
    from tasks.lineage.signed import sign_event

    # signed with the key of that state dir, which the CLI uses (an unsigned line is never sent)
    monkeypatch.setenv(SIGNING_KEY_FILE_ENV, str(tmp_path / "state" / "secrets" / "signing.key"))
    log.write_text(json.dumps(sign_event({"eventType": "START"})) + "\n")
    r = _crucible("--state-dir", str(tmp_path / "state"), "lineage", "replay", str(log), "--config", TINY,
                  "--set", f"lineage.service_port={free_port()}")
    assert r.returncode == 1 and "crucible up" in r.stderr and "Traceback" not in r.stderr


def test_filter_and_dedup_subcommands_on_real_documents(tmp_path):
    import gzip

    from tasks.config import DEFAULT_DATA_ROOT

    docs = tmp_path / "docs.jsonl"
    with gzip.open(DEFAULT_DATA_ROOT / "web" / "cc-main-2019-30-sample.jsonl.gz", "rt") as f, docs.open("w") as out:
        rows = [json.loads(line) for _, line in zip(range(40), f)]
        copies = [{**r, "id": r["id"] + "-copy"} for r in rows[:3]]  # exact copies for dedup to remove
        for r in rows + copies:
            out.write(json.dumps({"id": r["id"], "text": r["text"]}) + "\n")
    decisions, clusters = tmp_path / "decisions.jsonl", tmp_path / "clusters.jsonl"
    for cmd, out in (("filter", decisions), ("dedup", clusters)):
        proc = subprocess.run([sys.executable, "-m", "infra.cli", cmd, str(docs), "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in decisions.read_text().splitlines()]
    assert len(lines) == 43 and {"id", "keep", "reason", "scores"} <= set(lines[0])
    assert any(d["keep"] for d in lines) and any(not d["keep"] and d["reason"] for d in lines)
    result = [json.loads(x) for x in clusters.read_text().splitlines()]
    assert len(result) == 43 and sum(not r["keep"] for r in result) >= 3
