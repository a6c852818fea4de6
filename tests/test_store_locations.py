"""A tokenizer that lives on an object store (the champion of an object-store run, named by its URI) is
read there by every stage that takes it: tokens, deploy, and the torchrun job's lineage. A Path() of
its URI would make 's3://' 's3:/' (no such file): continuing from a store champion failed at the
tokens stage, a store run's fallback deploy read 's3:/...', and the tokenizer silently dropped out of
the torchrun job's lineage inputs. moto on loopback (tests/s3_helpers.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

TOKENIZER_KEY = "crucible/champ/tokenizer/tokenizer.json"
TOKENIZER_URI = f"s3://runs/{TOKENIZER_KEY}"


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An open store s3://runs/crucible holding a tokenizer (a champion's) at TOKENIZER_URI."""
    from lm_helpers import sample_tokenizer
    from s3_helpers import moto_s3
    from tasks.core import storage

    monkeypatch.setattr(storage, "_STORES", {})
    tok = sample_tokenizer(tmp_path / "tokenizer.json")
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        s3.client.upload_file(str(tok), "runs", TOKENIZER_KEY)
        yield s3, tok


def _shards(tmp_path: Path) -> list[str]:
    from lm_helpers import SAMPLE_TEXT, write_shards

    words = SAMPLE_TEXT.split()
    rows = [{"id": f"d{i}", "source": "test", "text": " ".join(words[i:i + 30])} for i in range(0, 600, 6)]
    return [str(p) for p in write_shards(rows, tmp_path / "shards", n_shards=2)]


def test_tokens_stage_encodes_with_a_tokenizer_on_the_store(store, tmp_path):
    """Same tokens as with the local file, and the index records the hash of the bytes read there."""
    from lm_helpers import tiny_cfg
    from tasks.core.hashing import sha256_file
    from tasks.core.layout import RunLayout
    from tasks.core.sections import stage_config
    from tasks.core.stage import StageContext, StageInputs
    from tasks.registry import STAGES

    _, tok = store
    cfg, shards = stage_config(STAGES["tokens"], tiny_cfg()), _shards(tmp_path)
    results = {}
    for name, tokenizer in (("local", str(tok)), ("store", TOKENIZER_URI)):
        ctx = StageContext(layout=RunLayout.for_run(tmp_path / "runs", name), run_name=name, tracking_uri="",
                           experiment="x")
        results[name] = STAGES["tokens"].run(cfg, StageInputs(tokenizer=tokenizer, shards=shards), ctx).data
    local, stored = results["local"], results["store"]
    assert stored["tokenizer_sha256"] == sha256_file(tok) == local["tokenizer_sha256"]
    for split in ("train", "val"):
        assert Path(stored["splits"][split]["path"]).read_bytes() == Path(local["splits"][split]["path"]).read_bytes()
    assert stored["splits"]["train"]["tokens"] > 0
    assert not (Path(stored["index_path"]).parent / "parts").exists()  # the jobs' tokenizer copy goes with them


def test_deploy_stage_hands_deploy_the_tokenizer_where_it_lies(store, tmp_path, monkeypatch):
    """The deploy stage's own deploy (no triggered flow) gets a location deploy can read."""
    import tasks.deploy
    from lm_helpers import tiny_cfg
    from tasks.core import fs
    from tasks.core.layout import RunLayout
    from tasks.core.stage import StageContext, StageInputs
    from tasks.core.storage import stored
    from tasks.registry import STAGES

    _, tok = store
    read = []

    def deploy_if_better(cfg, tracking_uri, evaluation, tokenizer, *args, **kwargs):
        read.append(fs.read_bytes(*stored(tokenizer)))  # what servable() does with it
        return {"reason": "refused by the test", "version": None}

    monkeypatch.setattr(tasks.deploy, "deploy_if_better", deploy_if_better)
    ctx = StageContext(layout=RunLayout.for_run(tmp_path / "runs", "r"), run_name="r", tracking_uri="", experiment="x")
    inputs = StageInputs(evaluation={"checkpoint": "s3://runs/crucible/r/train/checkpoints/step-000010"},
                         tokenizer=TOKENIZER_URI)
    STAGES["deploy"].run(tiny_cfg(), inputs, ctx)
    assert read == [tok.read_bytes()]


def test_torchrun_lineage_names_a_store_tokenizer_as_an_input(store, tmp_path):
    """The train stage hands TorchrunLineage the tokenizer as named; a store tokenizer whose hash is the
    one the token index records is an input of the torchrun job (named as its object)."""
    from tasks.core.hashing import sha256_file
    from tasks.lineage import JobRef
    from tasks.lineage.torchrun import TorchrunLineage

    s3, tok = store
    index = {"tokenizer_sha256": sha256_file(tok), "splits": {}}
    s3.client.put_object(Bucket="runs", Key="crucible/r/tokens/index.json", Body=json.dumps(index).encode())
    job = TorchrunLineage(emitter=None, parent=JobRef("train.torchrun_train", "run-1"), tokenizer=TOKENIZER_URI)
    names = [(d.namespace, d.name) for d in job.inputs("s3://runs/crucible/r/tokens/index.json")]
    assert ("s3://runs", TOKENIZER_KEY) in names
    assert ("s3://runs", "crucible/r/tokens/index.json") in names
    # a tokenizer other than the index's is not claimed as the job's input
    s3.client.put_object(Bucket="runs", Key=TOKENIZER_KEY, Body=tok.read_bytes() + b" ")
    assert ("s3://runs", TOKENIZER_KEY) not in [(d.namespace, d.name) for d in job.inputs(
        "s3://runs/crucible/r/tokens/index.json")]
