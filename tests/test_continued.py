"""Continued pretraining end to end (flows/continued.py) on real docs-crawl pages, with a real
temporary Prefect server, MLflow (SQLite), Ray and torchrun: cycle 1 bootstraps a champion from a
first delivery; a second delivery lands holding pages re-crawled from the first among new ones;
cycle 2 takes only that file, drops the re-crawled pages against cycle 1's MinHash index, encodes
with the champion's tokenizer, replays cycle-1 tokens, and starts from the champion's weights;
cycle 3 finds nothing new and trains nothing. Plus the refusals that come before anything starts."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from infra.settings import CrucibleConfig
from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, ContinueConfig, PipelineConfig

WEB = Path(__import__("os").environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT) / "web"
RECRAWLED = 40  # pages of the first delivery crawled again into the second


def write_warc(out: Path, records: list) -> None:
    """A gzipped WARC of (source file, record index, fresh record id) response records."""
    from warcio.archiveiterator import ArchiveIterator
    from warcio.warcwriter import WARCWriter

    wanted: dict[str, dict[int, bool]] = {}
    for src, i, fresh in records:
        wanted.setdefault(src, {})[i] = fresh
    tmp = out.with_suffix(".part")
    with open(tmp, "wb") as fh:
        writer = WARCWriter(fh, gzip=True)
        for src, picks in wanted.items():
            with open(WEB / src, "rb") as f:
                for i, rec in enumerate(r for r in ArchiveIterator(f) if r.rec_type == "response"):
                    if i > max(picks):
                        break
                    if i in picks:
                        if picks[i]:  # a re-crawl: another capture of the same page
                            rec.rec_headers.replace_header("WARC-Record-ID", f"<urn:uuid:{uuid.uuid4()}>")
                        writer.write_record(rec)
    tmp.rename(out)  # land by rename: discovery never sees a half-written file


def config(tmp: Path) -> PipelineConfig:
    return CrucibleConfig.model_validate({
        "name": "cont", "run_root": str(tmp / "runs"),
        "sources": [{"name": "landing", "uri": str(tmp / "landing" / "*.warc.gz"), "format": "warc",
                     "licence": "GPL-2.0+ OR CC-BY-SA-3.0; PSF-2.0; GPL-2.0", "provenance": "docs crawl deliveries"}],
        "ray": {"num_cpus": 2},
        "stack": {"state_dir": str(tmp / "state")},
        "lineage": {"http_enabled": False},
        "tokenizer": {"vocab_size": 512, "reference": False, "probes": {"enabled": False}},
        "tokens": {"val_fraction": 0.1, "ray": False},
        "model": {"n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 64},
        "train": {"nproc_per_node": 2, "max_steps": 20, "micro_batch_size": 4, "warmup_steps": 4,
                  "checkpoint_every": 20, "log_every": 5},
        "evaluate": {"max_val_batches": 2, "batch_size": 4, "sample_tokens": 4, "prompts": ["The"],
                     "wikitext": {"limit": 1}, "lambada": {"limit": 10}, "hellaswag": {"limit": 5}},
        "deploy": {"model_name": "cont-model", "serve": False, "max_val_loss": 20.0},
        "continue": {"replay_fraction": 0.25, "max_steps": 30, "rewarm_steps": 4, "lr": 1e-3},
    })


# a file that shows the cycle is inside that part of its DAG
KILL_POINTS = {"curation": Path("ingest"), "training": Path("train") / "train_log.jsonl"}


def kill_a_cycle(cfg: PipelineConfig, tmp: Path, during: str) -> dict:
    """`python -m flows.continued CONFIG` SIGKILLed (with its Ray and torchrun workers) once it is
    inside curation or training; returns what the ledger and the registry say right after."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import yaml
    from prefect.settings import PREFECT_API_URL

    from flows.run_context import default_tracking_uri
    from tasks.continued.ledger import Ledger
    from tasks.deploy.registry import get_champion

    path = tmp / "continue.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True)))
    before = {p.name for p in (tmp / "runs").glob("cont-*")}
    log = tmp / f"killed-during-{during}.log"
    proc = subprocess.Popen([sys.executable, "-m", "flows.continued", str(path)], cwd=tmp, start_new_session=True,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
                                 "PREFECT_API_URL": PREFECT_API_URL.value()})  # the test's Prefect server
    deadline, run_dir = time.monotonic() + 600, None
    while time.monotonic() < deadline and proc.poll() is None:
        started = [p for p in (tmp / "runs").glob("cont-*") if p.name not in before
                   and (p / KILL_POINTS[during]).exists()]
        if started:
            run_dir = started[0]
            break
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert run_dir is not None, log.read_text()[-3000:]
    ledger = Ledger.for_config(cfg, tmp / "state")
    champion = get_champion(default_tracking_uri(cfg), cfg.deploy.model_name)
    return {"run_name": run_dir.name, "status": ledger.cycle(run_dir.name).status,
            "offered": [Path(f.uri).name for f in ledger.discover(cfg).files], "champion": champion["version"]}


@pytest.fixture(scope="module")
def cycles(tmp_path_factory):
    """Three cycles through a real temporary Prefect server."""
    from prefect.testing.utilities import prefect_test_harness

    if not (WEB / "docs-crawl-00000.warc.gz").exists():
        pytest.skip(f"no data under {WEB}")
    from flows.continued import run_cycle

    tmp = tmp_path_factory.mktemp("continued")
    (tmp / "landing").mkdir()
    mp = pytest.MonkeyPatch()
    mp.chdir(tmp)
    mp.setenv("PREFECT_HOME", str(tmp / "prefect"))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.delenv("CRUCIBLE_STATE_DIR", raising=False)
    cfg = config(tmp)
    out = {"tmp": tmp, "cfg": cfg}
    try:
        with prefect_test_harness(server_startup_timeout=180):
            write_warc(tmp / "landing" / "delivery-1.warc.gz", [("docs-crawl-00000.warc.gz", i, False) for i in range(160)])
            out["c1"] = run_cycle(cfg)
            write_warc(tmp / "landing" / "delivery-2.warc.gz",
                       [("docs-crawl-00000.warc.gz", i, True) for i in range(RECRAWLED)]
                       + [("docs-crawl-00003.warc.gz", i, False) for i in range(160)])
            out["killed"] = [kill_a_cycle(cfg, tmp, during) for during in KILL_POINTS]
            out["c2"] = run_cycle(cfg)
            out["c3"] = run_cycle(cfg)
        yield out
    finally:
        mp.undo()


def test_cycle_one_bootstraps_a_champion(cycles):
    c1 = cycles["c1"]
    assert c1["status"] == "COMPLETED" and c1["cycle"]["number"] == 1 and c1["cycle"]["champion"] is None
    assert c1["stages"]["deploy"]["version"] == 1 and c1["stages"]["deploy"]["alias"] == "champion"
    assert set(c1["stages"]) >= {"tokenizer", "tokens", "train"}  # the full pretrain DAG


def test_cycle_two_reads_only_the_new_file(cycles):
    c2 = cycles["c2"]
    new = c2["cycle"]["discovery"]["sources"]["landing"]["new"]
    assert [Path(f["uri"]).name for f in new] == ["delivery-2.warc.gz"]
    assert [Path(f).name for f in c2["stages"]["ingest"]["sources"]["landing"]["files"]] == ["delivery-2.warc.gz"]


def test_recrawled_pages_are_dropped_against_cycle_one(cycles):
    """Each minhash_index drop of cycle 2 names a document cycle 1 kept; the re-crawled pages are
    among them, and no page cycle 1 kept is kept again."""
    import pyarrow.parquet as pq

    c1, c2 = cycles["c1"], cycles["c2"]
    curate = c2["stages"]["curate"]
    assert curate["docs_out"] + sum(curate["dropped"].values()) == curate["docs_in"]

    def urls(shards):
        return {r["id"]: r["url"] for s in shards for r in pq.read_table(s, columns=["id", "url"]).to_pylist()}

    kept_before, ingested_now = urls(c1["stages"]["curate"]["shards"]), urls(c2["stages"]["ingest"]["shards"])
    dropped = [json.loads(line) for line in (Path(c2["run_dir"]) / "curate" / "dropped.jsonl").read_text().splitlines()]
    against_index = [d for d in dropped if d["reason"] == "minhash_index"]
    assert 0 < len(against_index) == curate["dropped"]["minhash_index"] <= RECRAWLED
    assert all(d["duplicate_of"] in kept_before for d in against_index)
    recrawls = [d for d in against_index if ingested_now[d["id"]] == kept_before[d["duplicate_of"]]]
    assert recrawls  # (the others: new pages near-duplicating kept ones, e.g. another translation's page)
    # no page cycle 1 kept survives cycle 2's curation again
    kept_now = urls(c2["stages"]["curate"]["shards"])
    assert not set(kept_now.values()) & set(kept_before.values())


def test_tokenizer_is_frozen_and_step_zero_is_the_champion(cycles):
    from tasks.core.hashing import sha256_file
    from tasks.train.checkpoint import load_model_for_inference, weights_sha256

    c1, c2 = cycles["c1"], cycles["c2"]
    champion = c2["cycle"]["champion"]
    assert champion["version"] == 1 and champion["tokenizer"] == c1["stages"]["tokenizer"]["path"]
    assert c2["stages"]["tokens"]["tokenizer_sha256"] == sha256_file(c1["stages"]["tokenizer"]["path"])
    assert "tokenizer" not in c2["stages"]
    init = json.loads((Path(c2["run_dir"]) / "train" / "init.json").read_text())
    model, _ = load_model_for_inference(champion["checkpoint"])
    assert init["init_from"] == champion["checkpoint"] and init["weights_sha256"] == weights_sha256(model)


def test_replay_share_of_trained_tokens(cycles):
    mix = cycles["c2"]["stages"]["mix"]
    assert mix["mix"]["pool"][0] == cycles["c1"]["stages"]["tokens"]["index_path"]
    assert abs(mix["mix"]["replay_share"] - 0.25) <= 0.02
    # measured on the loader's real sample order over the steps trained (stratified: holds for 20 steps)
    assert mix["trained"]["trained_tokens"] > 0 and abs(mix["trained"]["replay_share"] - 0.25) <= 0.02
    # per-source token counts of the mix: in the summary, as MLflow metrics and on the mix's lineage dataset
    from mlflow.tracking import MlflowClient

    from tasks.lineage.validate import read_events
    from tasks.tracking.mlflow_tracking import metric_name

    by_source = mix["mix"]["by_source"]
    assert by_source and sum(v["tokens"] for v in by_source.values()) == mix["new_tokens"] + mix["replay_tokens"]
    metrics = MlflowClient(tracking_uri=cycles["c2"]["mlflow"]["tracking_uri"]).get_run(mix["mlflow_run_id"]).data.metrics
    assert all(metrics[metric_name(f"tokens.{s}")] == v["tokens"]
               and metrics[metric_name(f"replay_tokens.{s}")] == v["replay_tokens"]
               for s, v in by_source.items())
    facets = [o["facets"]["crucible_token_mix"] for e in read_events(cycles["c2"]["lineage_log"])
              for o in e.get("outputs") or [] if "crucible_token_mix" in (o.get("facets") or {})]
    assert facets and facets[-1]["by_source"] == by_source and facets[-1]["replay_share"] == mix["replay_share"]


def test_ledger_and_registry_record_the_cycles(cycles):
    from mlflow.tracking import MlflowClient

    from tasks.continued.ledger import Ledger

    cfg, c2 = cycles["cfg"], cycles["c2"]
    ledger = Ledger.for_config(cfg, cycles["tmp"] / "state")
    records = {r.cycle: r for r in ledger.cycles()}
    assert records[cycles["c1"]["run_name"]].status == records[c2["run_name"]].status == "committed"
    assert [Path(f.uri).name for f in ledger.consumed(c2["run_name"])] == ["delivery-2.warc.gz"]
    client = MlflowClient(tracking_uri=c2["mlflow"]["tracking_uri"])
    tags = client.get_run(c2["mlflow"]["run_id"]).data.tags
    assert tags["crucible.cycle"] == "2" and tags["crucible.parent_model_version"] == "1"
    if c2["stages"]["deploy"]["version"] is not None:
        mv = client.get_model_version("cont-model", str(c2["stages"]["deploy"]["version"]))
        assert mv.tags["continued_from"] == "1" and mv.tags["crucible.cycle"] == "2"


def test_third_cycle_without_new_files_trains_nothing(cycles):
    c3 = cycles["c3"]
    assert c3["status"] == "NO_NEW_DATA" and c3["message"].startswith("no new data")
    runs = {p.name for p in (cycles["tmp"] / "runs").glob("cont-*")}
    assert runs == {cycles["c1"]["run_name"], cycles["c2"]["run_name"], *(k["run_name"] for k in cycles["killed"])}


def test_refusals_before_anything_starts(cycles, tmp_path):
    from tasks.continued.cycle import CycleError, check_continuation, find_champion

    cfg = cycles["cfg"]
    store = cycles["c1"]["mlflow"]["tracking_uri"]
    champion = find_champion(cfg, store)
    wider = cfg.model_copy(update={"model": cfg.model.model_copy(update={"d_model": 128})})
    with pytest.raises(CycleError, match=r"model\.d_model: champion 64, config 128"):
        check_continuation(wider, champion)
    retrain = cfg.model_copy(update={"continue_": cfg.continue_.model_copy(update={"retrain_tokenizer": True})})
    with pytest.raises(CycleError, match="would\nnot be a continuation|not be a continuation"):
        check_continuation(retrain, champion)
    # training tokens to replay from that are gone: refused before anything starts, naming the file
    import dataclasses

    from tasks.continued.cycle import cycle_config
    from tasks.continued.ledger import Discovery, RawFile, SourceDiscovery

    new = RawFile(uri=str(tmp_path / "x.warc.gz"), source="landing", size=1, stamp="1", sha256="0" * 64, licence="t")
    discovery = Discovery([SourceDiscovery("landing", str(tmp_path / "*.warc.gz"), 1, [new])])
    gone = dataclasses.replace(champion, tokens_index=None)
    with pytest.raises(CycleError, match="nothing can be replayed"):
        cycle_config(cfg, discovery, gone, tmp_path / "state")
    no_replay = cfg.model_copy(update={"continue_": cfg.continue_.model_copy(update={"replay_fraction": 0.0})})
    assert cycle_config(no_replay, discovery, gone, tmp_path / "state").train.init_from == str(champion.checkpoint)


def test_gate_scores_both_models_on_one_yardstick(cycles):
    """Champion and challenger scored on the same pinned set (one sha256), in bits per byte per part;
    the deploy decision is the yardstick's, recorded with the set's hash."""
    from tasks.core.hashing import sha256_file
    from tasks.deploy.yardstick import decide

    c2, cfg = cycles["c2"], cycles["cfg"]
    y, deployed = c2["stages"]["yardstick"], c2["stages"]["deploy"]
    assert sha256_file(y["set"]["path"]) == y["set"]["sha256"] == deployed["yardstick"]["sha256"]
    assert y["set"]["parts"]["old"] > 0 and y["set"]["parts"]["new"] > 0 and y["set"]["parts"]["wikitext"] > 0
    assert set(y["challenger"]["bits_per_byte"]) == set(y["champion"]["bits_per_byte"]) == {"old", "new", "wikitext"}
    assert all(0 < v < 20 for who in ("challenger", "champion") for v in y[who]["bits_per_byte"].values())
    assert deployed["passed"] == y["decision"]["passed"] and deployed["reason"] == y["decision"]["reason"]
    from tasks.deploy.gate import read_gate_record

    # the stage's gate record is signed: verified as read (a rewritten one is refused, tests/test_signed_records.py)
    assert read_gate_record(Path(y["set"]["path"]).parent / "gate.json")["decision"] == y["decision"]
    ch, champ = y["challenger"]["bits_per_byte"], y["champion"]["bits_per_byte"]
    # the rule itself: a challenger worse on the new data is refused; one that forgets is refused
    assert not decide(cfg.deploy, {**ch, "new": champ["new"] + 0.1}, champ, {}, {})["passed"]
    assert not decide(cfg.deploy, {**champ, "new": champ["new"] - 0.1, "old": champ["old"] + 0.5}, champ, {}, {})["passed"]
    assert decide(cfg.deploy, {**champ, "new": champ["new"] - 0.1}, champ, {}, {})["passed"]
    if deployed["version"] is not None:
        from mlflow.tracking import MlflowClient

        tags = MlflowClient(tracking_uri=c2["mlflow"]["tracking_uri"]).get_model_version(
            "cont-model", str(deployed["version"])).tags
        assert tags["gate.yardstick_sha256"] == y["set"]["sha256"]
    print(json.dumps({k: y[k] for k in ("challenger", "champion", "decision")}, indent=1))


def test_schedule_is_registered_with_its_cron_and_can_be_changed(tmp_path, monkeypatch):
    """The deployment `crucible up` serves: the configured cron and time zone and a concurrency
    limit of 1, read back through the Prefect API; `crucible schedule` changes, pauses, resumes it."""
    import httpx
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from flows.continued import build_deployment, set_schedule

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    cfg = config(tmp_path).model_copy(update={"continue_": ContinueConfig(schedule="0 3 * * *",
                                                                          timezone="Europe/Berlin")})
    with prefect_test_harness(server_startup_timeout=180):
        deployment_id = build_deployment(cfg).apply()
        api = PREFECT_API_URL.value().rstrip("/")
        read = httpx.get(f"{api}/deployments/{deployment_id}", timeout=30).json()
        assert read["name"] == "continue-pretraining" and not read["paused"]
        assert [(s["schedule"]["cron"], s["schedule"]["timezone"]) for s in read["schedules"]] == [
            ("0 3 * * *", "Europe/Berlin")]
        assert read["global_concurrency_limit"]["limit"] == 1 and read["concurrency_options"]["collision_strategy"] == "ENQUEUE"
        assert read["parameters"]["config"]["continue_"]["schedule"] == "0 3 * * *"
        changed = set_schedule(cfg, cron="30 4 * * 1")
        assert changed["schedules"] == [{"cron": "30 4 * * 1", "timezone": "Europe/Berlin", "active": True}]
        assert set_schedule(cfg, paused=True)["paused"] is True
        assert httpx.get(f"{api}/deployments/{deployment_id}", timeout=30).json()["paused"] is True
        assert set_schedule(cfg, paused=False)["paused"] is False


def test_schedule_cli_refuses_a_bad_cron(tmp_path):
    import subprocess
    import sys

    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config(tmp_path).model_dump(mode="json", by_alias=True)))
    proc = subprocess.run([sys.executable, "-m", "infra.cli", "schedule", str(path), "--cron", "every night"],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 2 and "not a cron expression" in proc.stderr


def test_a_killed_cycle_leaves_champion_and_ledger_and_the_next_takes_its_files(cycles):
    """SIGKILL during curation, then during training: each time the champion stays, the ledger
    offers the same file, and the cycle after them takes it."""
    c2 = cycles["c2"]
    for killed in cycles["killed"]:
        assert killed["status"] == "pending" and killed["offered"] == ["delivery-2.warc.gz"]
        assert killed["champion"] == 1 and c2["run_name"] != killed["run_name"]
    assert c2["cycle"]["number"] == 2
    assert [Path(f["uri"]).name for f in c2["cycle"]["discovery"]["sources"]["landing"]["new"]] == ["delivery-2.warc.gz"]


def test_upstream_lineage_of_the_cycle_reaches_the_raw_files_of_both_cycles(cycles):
    """Walking the two runs' lineage events upstream from cycle 2's model (its registered version,
    else its last checkpoint) reaches both deliveries' raw files."""
    from tasks.lineage.validate import read_events

    c1, c2 = cycles["c1"], cycles["c2"]
    events = read_events(c1["lineage_log"]) + read_events(c2["lineage_log"])
    produced_by: dict[str, set[str]] = {}
    for e in events:
        for o in e.get("outputs") or []:
            produced_by.setdefault(f"{o['namespace']}:{o['name']}", set()).update(
                f"{i['namespace']}:{i['name']}" for i in e.get("inputs") or [])
    deployed = c2["stages"]["deploy"]
    if deployed["version"] is not None:
        start = next(n for n in produced_by if n.endswith(f"models/cont-model/{deployed['version']}"))
    else:
        start = next(n for n in produced_by if n.endswith(str(Path(c2["stages"]["train"]["checkpoints"][-1]))))
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(produced_by.get(node, ()))
    raw = {Path(n.split(":", 1)[1]).name for n in seen if n.endswith(".warc.gz")}
    assert {"delivery-1.warc.gz", "delivery-2.warc.gz"} <= raw, sorted(raw)


def test_the_rewarm_is_not_mistaken_for_loss_spikes(cycles):
    spikes = Path(cycles["c2"]["run_dir"]) / "train" / "spikes.jsonl"
    skipped = [json.loads(line) for line in spikes.read_text().splitlines()] if spikes.is_file() else []
    assert sum(s.get("action") == "skip" for s in skipped) <= 0.005 * cycles["c2"]["stages"]["train"]["steps"]


def test_mix_holds_the_replay_share_in_every_stretch_of_training(base, tmp_path):
    """build_mix appends whole replayed documents up to the configured share; the training loader
    interleaves the two strata evenly, so any prefix of samples has the share up to one window (a
    plain permutation of all windows would not), and trained_replay_share measures it."""
    import numpy as np

    from lm_helpers import tokens_artifact
    from tasks.continued.mix import MixError, build_mix, trained_replay_share
    from tasks.tokens.binfile import open_doc_starts, open_split
    from tasks.train.data import GlobalWindows

    new = tokens_artifact(base)["index_path"]
    mix = build_mix(new, [Path(new)], 0.25, 0, tmp_path / "mix")
    info = mix["mix"]
    assert abs(info["replay_share"] - 0.25) < 0.02 and info["replay_docs"] > 0
    tokens, starts = open_split(mix["index_path"], "train"), open_doc_starts(mix["index_path"], "train")
    assert len(tokens) == info["new_tokens"] + info["replay_tokens"] and starts[-1] < len(tokens)
    assert np.array_equal(tokens[:info["new_tokens"]], open_split(new, "train"))  # new tokens first, unchanged
    windows = GlobalWindows(mix["index_path"], "train", 64, 4, seed=5)
    replay_windows = windows.n_windows - windows.n_new
    for k in (10, 37, 100, windows.n_windows):
        got = sum(windows.window_start(g) >= windows.n_new * 64 for g in range(k))
        assert abs(got - k * replay_windows / windows.n_windows) <= 1, (k, got)
    # tokens per data source: the new index's own, plus each replayed document's source
    from tasks.tokens.binfile import doc_source_names, load_index

    by_source, new_index = info["by_source"], load_index(new)
    assert set(by_source) == set(new_index["sources"]) == {"gutenberg", "linux-doc"}
    for source, v in by_source.items():
        assert v["new_tokens"] == new_index["by_source"][source]["train"]["tokens"]
        assert v["tokens"] == v["new_tokens"] + v["replay_tokens"]
    assert sum(v["replay_tokens"] for v in by_source.values()) == info["replay_tokens"]
    assert sum(v["share"] for v in by_source.values()) == pytest.approx(1.0)
    names = doc_source_names(mix["index_path"], "train")
    assert len(names) == len(starts) and names[len(open_doc_starts(new, "train")):].count("gutenberg") > 0
    # a pool index from before token indexes recorded sources (and were signed): its replayed tokens are
    # "(unknown)"; taken as a champion's replay pool hands it over, vouched for by the mix's pool_sha256
    from tasks.core.hashing import sha256_file
    from tasks.tokens.binfile import write_index

    old = json.loads(Path(new).read_text())
    for split in old["splits"].values():
        split.pop("doc_sources", None)
        split["path"], split["doc_starts"] = str(Path(new).parent / split["path"]), str(Path(new).parent / split["doc_starts"])
    (tmp_path / "older").mkdir()
    older_index = tmp_path / "older" / "index.json"
    older_index.write_text(json.dumps({k: v for k, v in old.items() if k not in ("sources", "signature")}))
    older = build_mix(new, {str(older_index): sha256_file(older_index)}, 0.25, 0,
                      tmp_path / "mix-older")["mix"]["by_source"]
    assert older["(unknown)"]["new_tokens"] == 0 and older["(unknown)"]["replay_tokens"] > 0
    share = trained_replay_share(mix["index_path"], 64, 5, 100)
    assert abs(share["replay_share"] - info["replay_share"]) < 0.03 and share["trained_tokens"] == 100 * 64
    other = dict(old, tokenizer_sha256="0" * 64)
    (tmp_path / "other").mkdir()
    write_index(tmp_path / "other" / "index.json", other)  # signed, by another tokenizer
    with pytest.raises(MixError, match="tokenizer"):
        build_mix(new, [tmp_path / "other" / "index.json"], 0.25, 0, tmp_path / "bad")


def test_a_wsd_champion_continues_from_its_pre_decay_checkpoint(tmp_path):
    """continue.lr_schedule wsd / auto: a champion trained warmup-stable-decay is continued from its
    run's last kept checkpoint before the decay (verified against the run's checkpoint manifest),
    with a new stable phase and decay; refused (wsd) or re-warmed (auto) when that cannot be done."""
    import shutil

    from lm_helpers import random_checkpoint, sample_tokenizer
    from tasks.continued.cycle import Champion, CycleError, cycle_config
    from tasks.continued.ledger import Discovery, RawFile, SourceDiscovery
    from tasks.core.hashing import sha256_file, sha256_tree
    from tasks.train.checkpoint import META_FILE, apply_retention
    from tasks.train.schedule import lr_at, schedule_record

    cfg = config(tmp_path)
    cfg = cfg.model_copy(update={"continue_": cfg.continue_.model_copy(update={"replay_fraction": 0.0})})
    tok = sample_tokenizer(tmp_path / "tokenizer.json")
    champion_cfg = cfg.train.model_copy(update={"lr_schedule": "wsd", "max_steps": 30, "warmup_steps": 5,
                                                "wsd_decay_fraction": 0.4})  # decay from step 18
    train_dir = tmp_path / "runs" / "champ" / "train"
    model = {"n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 64}
    ckpts = {}
    for step in (10, 20, 30):
        ckpts[step] = random_checkpoint(train_dir, tok, step, step, meta_extra={"schedule": schedule_record(champion_cfg)},
                                        **model)
        apply_retention(train_dir, ckpts[step], None)

    def champion(ckpt):
        from tasks.train.checkpoint import read_meta

        return Champion("cont-model", 1, ckpt, sha256_tree(ckpt), tok, sha256_file(tok), None,
                        read_meta(ckpt)["model"], "champ", None, {})

    new = RawFile(uri=str(tmp_path / "landing" / "a.warc.gz"), source="landing", size=1, stamp="1", sha256="0" * 64,
                  licence="test")
    discovery = Discovery([SourceDiscovery("landing", str(tmp_path / "landing" / "*.warc.gz"), 1, [new])])
    for schedule in ("wsd", "auto"):
        wsd = cfg.model_copy(update={"continue_": cfg.continue_.model_copy(update={"lr_schedule": schedule})})
        cycle = cycle_config(wsd, discovery, champion(ckpts[30]), tmp_path / "state")
        t = cycle.train
        assert t.init_from == str(ckpts[10]) and t.init_sha256 == sha256_tree(ckpts[10]) and t.lr_schedule == "wsd"
        # a new stable phase at continue.lr (no re-warm unless asked), then the decay
        assert t.warmup_steps == 4 and lr_at(10, t) == lr_at(18, t) == 1e-3 and lr_at(30, t) < lr_at(25, t) < 1e-3
    # the re-warmed cosine when asked for, from the champion itself
    cosine = cycle_config(cfg.model_copy(update={"continue_": cfg.continue_.model_copy(
        update={"lr_schedule": "rewarm_cosine"})}), discovery, champion(ckpts[30]), tmp_path / "state")
    assert cosine.train.init_from == str(ckpts[30]) and cosine.train.lr_schedule == "cosine"
    wsd = cfg.model_copy(update={"continue_": cfg.continue_.model_copy(update={"lr_schedule": "wsd"})})
    auto = cfg.model_copy(update={"continue_": cfg.continue_.model_copy(update={"lr_schedule": "auto"})})
    # a pre-decay checkpoint that differs from the run's manifest is refused
    meta_file = ckpts[10] / META_FILE
    meta_file.write_text(meta_file.read_text() + " ")
    with pytest.raises(CycleError, match="manifest"):
        cycle_config(auto, discovery, champion(ckpts[30]), tmp_path / "state")
    # none kept: wsd is refused, naming why; auto re-warms from the champion
    shutil.rmtree(ckpts[10])
    apply_retention(train_dir, None, None)
    with pytest.raises(CycleError, match="no checkpoint of the champion's run at or before step 18"):
        cycle_config(wsd, discovery, champion(ckpts[30]), tmp_path / "state")
    assert cycle_config(auto, discovery, champion(ckpts[30]), tmp_path / "state").train.init_from == str(ckpts[30])
    # a champion trained with cosine: wsd is refused
    cosine_dir = tmp_path / "runs" / "cos" / "train"
    plain = random_checkpoint(cosine_dir, tok, 10, 0, meta_extra={"schedule": schedule_record(cfg.train)}, **model)
    with pytest.raises(CycleError, match="not wsd"):
        cycle_config(wsd, discovery, champion(plain), tmp_path / "state")
    # never from past the champion: a later checkpoint of its run (before the decay) was not gated
    early_dir = tmp_path / "runs" / "early" / "train"
    early = {step: random_checkpoint(early_dir, tok, step, step, meta_extra={"schedule": schedule_record(champion_cfg)},
                                     **model) for step in (5, 12)}
    assert cycle_config(wsd, discovery, champion(early[5]), tmp_path / "state").train.init_from == str(early[5])


def test_a_second_cycle_waits_for_the_running_one_and_says_so(tmp_path):
    """One cycle of a model at a time, however started: while a cycle holds the model's slot (here
    the test holds it), `python -m flows.continued` says it waits, and runs once the slot is free."""
    import os
    import subprocess
    import sys
    import time
    from contextlib import ExitStack

    import yaml

    from flows.continued import hold_cycle_slot

    (tmp_path / "landing").mkdir()
    cfg = config(tmp_path)
    path = tmp_path / "continue.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True)))
    log = tmp_path / "second.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "CRUCIBLE_"))}
    with ExitStack() as running:
        assert hold_cycle_slot(cfg, running) == 0.0
        proc = subprocess.Popen([sys.executable, "-m", "flows.continued", str(path)], cwd=tmp_path,
                                stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                env={**env, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
                                     "PREFECT_HOME": str(tmp_path / "prefect")})
        deadline = time.monotonic() + 240
        while "waits for it to finish" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2)
        assert proc.poll() is None and "waits for it to finish" in log.read_text(), log.read_text()[-3000:]
    assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    out = log.read_text()
    assert "the other cycle finished; starting after" in out and "no new data" in out.lower(), out[-3000:]


def test_crucible_up_registers_the_schedule_and_crucible_schedule_changes_it(tmp_path):
    """The user's path: `crucible up --config` registers the continue-pretraining deployment (and
    pretrain, with the same config) to the stack's work pool, whose worker runs them; the deployment
    is in Prefect with the configured cron; `crucible schedule` pauses it."""
    import subprocess
    import sys

    import httpx
    import yaml

    from tasks.core.net import free_port

    repo = Path(__file__).resolve().parent.parent
    raw = config(tmp_path).model_dump(mode="json", by_alias=True)
    raw["stack"].update(prefect_port=free_port(), mlflow_port=free_port(), worker_port=free_port(),
                        start_timeout=240, stop_timeout=15)
    raw["lineage"]["service_port"] = free_port()
    raw["continue"].update(schedule="15 2 * * *", timezone="Europe/Paris")
    path = tmp_path / "continue.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "CRUCIBLE_"))}

    def crucible(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "infra.cli", *args], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=400)

    try:
        up = crucible("up", "--config", str(path), "--json")
        assert up.returncode == 0, (up.stdout + up.stderr)[-3000:]
        services = json.loads(up.stdout)
        assert services["worker"]["healthy"], services
        assert set(services["worker"]["deployments"]) == {
            "continue-pretraining/continue-pretraining", "pretrain/pretrain", "evaluate-checkpoint/evaluate-checkpoint",
            "deploy-model/deploy-model"}, services
        api = f"http://127.0.0.1:{raw['stack']['prefect_port']}/api"
        from infra import stack
        from infra.settings import StackConfig

        headers = stack.prefect_headers(StackConfig(state_dir=raw["stack"]["state_dir"]))
        assert httpx.post(f"{api}/deployments/filter", timeout=30, json={}).status_code == 401  # auth is on
        read = httpx.post(f"{api}/deployments/filter", timeout=30, headers=headers,
                          json={"deployments": {"name": {"any_": ["continue-pretraining"]}}}).json()
        assert [(s["schedule"]["cron"], s["schedule"]["timezone"]) for s in read[0]["schedules"]] == [
            ("15 2 * * *", "Europe/Paris")]
        assert read[0]["work_pool_name"] == "crucible" and read[0]["entrypoint"] == "flows.continued.continue_pretraining"
        assert read[0]["job_variables"]["working_dir"] == str(repo)  # where `crucible up` ran: relative paths hold
        assert read[0]["parameters"]["config"]["continue_"]["schedule"] == "15 2 * * *"
        paused = crucible("schedule", str(path), "--pause")
        assert paused.returncode == 0 and json.loads(paused.stdout)["paused"] is True, paused.stderr[-2000:]
        # `crucible run --continue` runs one cycle now, through the stack: nothing has landed yet
        now = crucible("run", "--continue", str(path))
        assert now.returncode == 0 and "no new data" in now.stdout and "nothing was trained" in now.stdout, \
            (now.stdout + now.stderr)[-3000:]
    finally:
        crucible("down", "--config", str(path))


def test_a_pre_decay_start_swapped_after_its_check_is_not_trained_from(tmp_path, monkeypatch):
    """Attack: the pre-decay checkpoint verifies against its run's signed manifest, then its files are
    swapped for another checkpoint's before the cycle records init_sha256. The hash training must
    match comes from the signed manifest entry checked, not from reading the files again."""
    import shutil

    from lm_helpers import random_checkpoint, sample_tokenizer
    from tasks.continued.cycle import Champion, cycle_config
    from tasks.continued.ledger import Discovery, RawFile, SourceDiscovery
    from tasks.core.hashing import sha256_file, sha256_tree
    from tasks.train import checkpoint
    from tasks.train.schedule import schedule_record

    cfg = config(tmp_path)
    cfg = cfg.model_copy(update={"continue_": cfg.continue_.model_copy(update={"replay_fraction": 0.0,
                                                                               "lr_schedule": "wsd"})})
    tok = sample_tokenizer(tmp_path / "tokenizer.json")
    wsd = cfg.train.model_copy(update={"lr_schedule": "wsd", "max_steps": 30, "warmup_steps": 5,
                                       "wsd_decay_fraction": 0.4})
    train_dir = tmp_path / "runs" / "champ" / "train"
    ckpts = {step: random_checkpoint(train_dir, tok, step, step, meta_extra={"schedule": schedule_record(wsd)},
                                     n_layer=2, n_head=4, d_model=64, seq_len=64) for step in (10, 30)}
    genuine = sha256_tree(ckpts[10])
    real_check, swaps = checkpoint.checkpoint_problem, []

    def check_then_swap(*a, **kw):
        problem = real_check(*a, **kw)
        if not swaps:
            shutil.rmtree(ckpts[10])
            shutil.copytree(ckpts[30], ckpts[10])  # weights the run never had at step 10
            swaps.append(True)
        return problem

    monkeypatch.setattr(checkpoint, "checkpoint_problem", check_then_swap)
    champion = Champion("cont-model", 1, ckpts[30], sha256_tree(ckpts[30]), tok, sha256_file(tok), None,
                        checkpoint.read_meta(ckpts[30])["model"], "champ", None, {})
    new = RawFile(uri=str(tmp_path / "landing" / "a.warc.gz"), source="landing", size=1, stamp="1", sha256="0" * 64,
                  licence="test")
    discovery = Discovery([SourceDiscovery("landing", str(tmp_path / "landing" / "*.warc.gz"), 1, [new])])
    t = cycle_config(cfg, discovery, champion, tmp_path / "state").train
    assert swaps and sha256_tree(ckpts[10]) != genuine  # the swap happened
    assert t.init_from == str(ckpts[10]) and t.init_sha256 == genuine


def test_a_champion_swapped_after_its_hash_check_is_not_trained_from(tmp_path, monkeypatch):
    """Attack: the champion's own files hash to its signed content hash, then are swapped for another
    checkpoint's before the cycle records the hash training must match. Champion.checkpoint_sha256 is
    the tree hash registered_files checked against the content hash, not a second read."""
    import shutil

    from lm_helpers import random_checkpoint, sample_tokenizer
    from tasks.continued import cycle
    from tasks.core import fs
    from tasks.core.hashing import sha256_file, sha256_tree
    from tasks.deploy import registry

    tok = sample_tokenizer(tmp_path / "tokenizer.json")
    ckpt = random_checkpoint(tmp_path / "runs" / "champ" / "train", tok, 10, 1)
    other = random_checkpoint(tmp_path / "runs" / "other" / "train", tok, 10, 2)
    genuine = sha256_tree(ckpt)
    tags = {"checkpoint": str(ckpt), "tokenizer": str(tok), "run_name": "champ",
            "content_hash": registry.content_hash_of(genuine, sha256_file(tok))}
    monkeypatch.setattr(registry, "get_champion", lambda *a: {"version": 1, "tags": tags, "run_id": None})
    real_tree, swaps = fs.tree_sha256, []

    def hash_then_swap(*a, **kw):
        digest = real_tree(*a, **kw)
        if not swaps:
            shutil.rmtree(ckpt)
            shutil.copytree(other, ckpt)
            swaps.append(True)
        return digest

    monkeypatch.setattr(fs, "tree_sha256", hash_then_swap)
    champion = cycle.find_champion(config(tmp_path), "sqlite:///unused.db")
    assert swaps and sha256_tree(ckpt) != genuine  # the swap happened
    assert champion.checkpoint == ckpt and champion.checkpoint_sha256 == genuine


def test_a_replay_pool_on_a_store_is_found_there(tmp_path, monkeypatch):
    """A champion trained from an object-store run: its replay pool's token indexes are URIs, asked on
    their store (Path(uri).is_file() is never true: the pool was reported gone and the cycle refused)."""
    from lm_helpers import random_checkpoint, sample_tokenizer
    from s3_helpers import moto_s3
    from tasks.continued import mix
    from tasks.continued.cycle import Champion, CycleError, cycle_config
    from tasks.continued.ledger import Discovery, RawFile, SourceDiscovery
    from tasks.core import storage
    from tasks.core.hashing import sha256_file, sha256_tree
    from tasks.train.checkpoint import read_meta

    monkeypatch.setattr(storage, "_STORES", {})
    cfg = config(tmp_path)
    cfg = cfg.model_copy(update={"continue_": cfg.continue_.model_copy(update={"replay_fraction": 0.3,
                                                                               "lr_schedule": "rewarm_cosine"})})
    tok = sample_tokenizer(tmp_path / "tokenizer.json")
    ckpt = random_checkpoint(tmp_path / "runs" / "champ" / "train", tok, 10, 1, n_layer=2, n_head=4, d_model=64,
                             seq_len=64)
    champion = Champion("cont-model", 1, ckpt, sha256_tree(ckpt), tok, sha256_file(tok), None,
                        read_meta(ckpt)["model"], "champ", None, {})
    new = RawFile(uri=str(tmp_path / "landing" / "a.warc.gz"), source="landing", size=1, stamp="1", sha256="0" * 64,
                  licence="test")
    discovery = Discovery([SourceDiscovery("landing", str(tmp_path / "landing" / "*.warc.gz"), 1, [new])])
    pool = ["s3://runs/crucible/r1/tokens/index.json"]
    monkeypatch.setattr(mix, "replay_pool", lambda *a: pool)
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        with pytest.raises(CycleError, match="gone"):  # not there yet
            cycle_config(cfg, discovery, champion, tmp_path / "state")
        s3.client.put_object(Bucket="runs", Key="crucible/r1/tokens/index.json", Body=b"{}")
        assert cycle_config(cfg, discovery, champion, tmp_path / "state").train.init_from == str(ckpt)


def test_a_replay_pool_on_a_store_is_mixed_where_it_lives(base, tmp_path, monkeypatch):
    """Continuing from an object-store champion with replay: the new tokens and the pool's token indexes
    are URIs, and build_mix reads them on the store (index, document starts and sources, the train split
    held to the sha256 its index records): the same mix as from local files. A train split swapped on the
    store is refused, never replayed."""
    import hashlib

    import numpy as np

    from lm_helpers import tokens_artifact
    from s3_helpers import moto_s3
    from tasks.continued.mix import MixError, build_mix
    from tasks.core import storage
    from tasks.evaluate.evaluate import val_tokens
    from tasks.tokens.binfile import open_split

    new = Path(tokens_artifact(base)["index_path"])
    local = build_mix(new, [new], 0.25, 0, tmp_path / "local")
    monkeypatch.setattr(storage, "_STORES", {})
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        for p in new.parent.iterdir():
            s3.client.upload_file(str(p), "runs", f"crucible/r1/tokens/{p.name}")
        uri = "s3://runs/crucible/r1/tokens/index.json"
        mixed = build_mix(uri, [uri], 0.25, 0, tmp_path / "store")
        assert np.array_equal(open_split(mixed["index_path"], "train"), open_split(local["index_path"], "train"))
        assert mixed["mix"]["by_source"] == local["mix"]["by_source"] and mixed["mix"]["pool"] == [uri, uri]
        assert mixed["mix"]["pool_sha256"][uri] == hashlib.sha256(new.read_bytes()).hexdigest()
        # the held-out split stays where the tokens stage wrote it, read there by evaluation
        assert mixed["splits"]["val"]["path"].startswith("s3://runs/crucible/r1/tokens/")
        assert np.array_equal(val_tokens(mixed["index_path"], s3.options)[1], val_tokens(new)[1])

        train = f"crucible/r1/tokens/{json.loads(new.read_text())['splits']['train']['path']}"
        body = s3.client.get_object(Bucket="runs", Key=train)["Body"].read()
        s3.client.put_object(Bucket="runs", Key=train, Body=bytes(reversed(body)))
        with pytest.raises(MixError, match="sha256"):
            build_mix(new, [uri], 0.25, 0, tmp_path / "swapped")


def _token_copy(base: Path, dest: Path) -> Path:
    """A copy of the session's token folder (its signed index and files) at `dest`: its index.json."""
    import shutil

    from lm_helpers import tokens_artifact

    shutil.copytree(Path(tokens_artifact(base)["index_path"]).parent, dest)
    return dest / "index.json"


def test_an_unsigned_token_index_is_never_mixed_into_a_signed_one(base, tmp_path):
    """Attack: a hand-written (unsigned) token index naming other tokens, as a pool member or as the
    new tokens, would come out of build_mix inside a mix index the stack signs. build_mix refuses it,
    names it and says the remedy; malformed JSON is a MixError naming the index too."""
    from tasks.continued.mix import MixError, build_mix

    new = _token_copy(base, tmp_path / "tokens")
    forged = dict(json.loads(new.read_text()))
    forged.pop("signature")
    forged["sources"] = ["attacker"] + forged["sources"][1:]
    (tmp_path / "evil").mkdir()
    for p in new.parent.iterdir():
        if p.name != "index.json":
            (tmp_path / "evil" / p.name).write_bytes(p.read_bytes())
    evil = tmp_path / "evil" / "index.json"
    evil.write_text(json.dumps(forged))
    with pytest.raises(MixError, match=rf"(?s){evil}.*tokens stage"):
        build_mix(new, [evil], 0.25, 0, tmp_path / "mix-pool")
    with pytest.raises(MixError, match=rf"(?s){evil}.*tokens stage"):
        build_mix(evil, [new], 0.25, 0, tmp_path / "mix-new")
    assert not (tmp_path / "mix-pool" / "index.json").exists() and not (tmp_path / "mix-new" / "index.json").exists()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(MixError, match=str(bad)):
        build_mix(new, [bad], 0.25, 0, tmp_path / "mix-bad")


def test_a_local_train_split_swapped_after_its_index_is_signed_is_refused(base, tmp_path):
    """Attack: the tokens a signed local index lists are changed after it was written (train.bin
    reversed, document starts moved): build_mix refuses them (MixError naming the file), never
    replays them or re-signs their hashes. A pool member handed over with the sha256 a signed chain
    vouches for (replay_pool's champion -> mix -> pool_sha256) must still have it."""
    import numpy as np

    from tasks.continued.mix import MixError, build_mix
    from tasks.core.hashing import sha256_file

    new = _token_copy(base, tmp_path / "new")
    pool = _token_copy(base, tmp_path / "pool")
    train = pool.parent / json.loads(pool.read_text())["splits"]["train"]["path"]
    train.write_bytes(bytes(reversed(train.read_bytes())))
    with pytest.raises(MixError, match=rf"{train}.*sha256"):
        build_mix(new, [pool], 0.25, 0, tmp_path / "mix")
    starts = new.parent / json.loads(new.read_text())["splits"]["train"]["doc_starts"]
    moved = np.load(starts)
    np.save(starts, np.concatenate([[0], moved[2:]]))
    with pytest.raises(MixError, match=rf"{starts}.*sha256"):
        build_mix(new, [new], 0.25, 0, tmp_path / "mix-starts")
    genuine = _token_copy(base, tmp_path / "genuine")
    with pytest.raises(MixError, match=rf"{genuine}.*vouche"):  # not the bytes the champion's chain holds
        build_mix(genuine, {str(genuine): "0" * 64}, 0.25, 0, tmp_path / "mix-vouched")
    assert build_mix(genuine, {str(genuine): sha256_file(genuine)}, 0.25, 0, tmp_path / "ok")["mix"]["replay_docs"] > 0
    # an index written before it recorded its document sources' hash: described as such, with the remedy
    from tasks.tokens.binfile import write_index

    unhashed = json.loads(genuine.read_text())
    unhashed["splits"]["train"].pop("doc_sources_sha256")
    write_index(genuine, unhashed)
    with pytest.raises(MixError, match=r"records no sha256 for it \(doc_sources.*tokens stage"):
        build_mix(_token_copy(base, tmp_path / "fresh"), [genuine], 0.25, 0, tmp_path / "mix-unhashed")


def test_the_mix_stage_holds_the_pool_to_the_hashes_the_champion_vouches_for(base, tmp_path):
    """The cycle hands the mix stage vouched_pool's {index: sha256} (champion's signed tag -> its mix ->
    pool_sha256): a member whose bytes are not those is refused, even one the stack signed (another
    genuine index put in its place); with the vouched hash it is mixed and recorded as read."""
    from lm_helpers import tiny_cfg
    from tasks.continued.mix import MixError
    from tasks.core.hashing import sha256_file
    from tasks.core.layout import RunLayout
    from tasks.core.sections import stage_config
    from tasks.core.stage import StageContext, StageInputs
    from tasks.registry import STAGES

    new, member = _token_copy(base, tmp_path / "new"), _token_copy(base, tmp_path / "member")
    stage, ctx = STAGES["mix"], StageContext(layout=RunLayout.for_run(tmp_path, "r"), run_name="r", tracking_uri="",
                                             experiment="x")
    cfg = stage_config(stage, tiny_cfg())
    with pytest.raises(MixError, match=rf"{member}.*vouched"):
        stage.run(cfg, StageInputs(tokens_index=str(new), replay={str(member): "0" * 64}), ctx)
    vouched = {str(member): sha256_file(member)}
    mixed = stage.run(cfg, StageInputs(tokens_index=str(new), replay=vouched), ctx).data
    assert mixed["mix"]["pool_sha256"][str(member)] == vouched[str(member)] and mixed["replay_tokens"] > 0


def test_a_champion_index_that_fails_its_hash_is_reported_as_changed_not_gone(tmp_path):
    """The champion's token index is there but does not hash to its signed data.tokens_index_sha256:
    the cycle refuses before anything starts and says the index was refused as changed (telling the
    user to restore files that are there would send them the wrong way)."""
    from lm_helpers import random_checkpoint, sample_tokenizer
    from tasks.continued.cycle import Champion, CycleError, cycle_config
    from tasks.continued.ledger import Discovery, RawFile, SourceDiscovery
    from tasks.core.hashing import sha256_file, sha256_tree
    from tasks.train.checkpoint import read_meta

    cfg = config(tmp_path)
    tok = sample_tokenizer(tmp_path / "tokenizer.json")
    ckpt = random_checkpoint(tmp_path / "runs" / "champ" / "train", tok, 10, 0, n_layer=2, n_head=4, d_model=64,
                             seq_len=64)
    index = tmp_path / "runs" / "champ" / "tokens" / "index.json"
    index.parent.mkdir(parents=True)
    index.write_text(json.dumps({"splits": {}}))
    tags = {"data.tokens_index": str(index), "data.tokens_index_sha256": "0" * 64}
    champion = Champion("cont-model", 1, ckpt, sha256_tree(ckpt), tok, sha256_file(tok), None,
                        read_meta(ckpt)["model"], "champ", None, tags)
    new = RawFile(uri=str(tmp_path / "a.warc.gz"), source="landing", size=1, stamp="1", sha256="0" * 64, licence="t")
    discovery = Discovery([SourceDiscovery("landing", str(tmp_path / "*.warc.gz"), 1, [new])])
    with pytest.raises(CycleError, match=rf"{index} was refused as changed"):
        cycle_config(cfg, discovery, champion, tmp_path / "state")
    index.unlink()
    with pytest.raises(CycleError, match="are gone"):
        cycle_config(cfg, discovery, champion, tmp_path / "state")
