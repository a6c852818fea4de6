"""The MLflow registry is a record the pipeline trusts only where the stack signed it (issue 24).

Anyone who can reach MLflow can write a model version's tags, move an alias, create a version or log
artifacts. Each test is such a write, done with a plain MlflowClient as an outsider would (no signing
key involved), against a champion the pipeline registered and promoted; every entry point that reads
the registry (the gate and its yardstick, continued pretraining, the model server's reload,
verification of a registered copy) must refuse what was forged and never run what was planted."""
from __future__ import annotations

import json
import pickle
import shutil
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from attack_helpers import WritesMarker
from infra.settings import CrucibleConfig
from tasks.config import PipelineConfig


@pytest.fixture(scope="module")
def trained(run, base):
    """The session's real training run: steps 10 and 20, with their tokenizer."""
    from lm_helpers import tokenizer_artifact

    ckpts = {int(Path(c).name.split("-")[-1]): c for c in run["checkpoints"]}
    return {"tokenizer": Path(tokenizer_artifact(base)["path"]), 10: ckpts[10], 20: ckpts[20]}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry-trust")
    return {"uri": f"sqlite:///{root / 'mlflow.db'}", "root": root}


def _cfg(root: Path, name: str) -> PipelineConfig:
    cfg = CrucibleConfig.model_validate({
        "name": "t", "run_root": str(root / "runs"),
        "sources": [{"name": "s", "uri": "x.jsonl", "format": "jsonl", "licence": "CC0", "provenance": "test"}],
        "deploy": {"max_val_loss": 8.0, "serve": False, "model_name": name},
        "stack": {"state_dir": str(root / "state")}})
    return cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(update={
        "wikitext": cfg.evaluate.wikitext.model_copy(update={"limit": 2})})})


def _champion(trained, store, tmp_path) -> tuple[PipelineConfig, str]:
    """A champion the pipeline registered, verified and promoted (step 20), under a name of its own."""
    from tasks.deploy import deploy_if_better

    name = f"trust-{uuid.uuid4().hex[:8]}"
    cfg = _cfg(tmp_path, name)
    ev = {"val_loss": 6.0, "step": 20, "checkpoint": trained[20], "task_metrics": {"hellaswag_acc": 0.3}}
    first = deploy_if_better(cfg, store["uri"], ev, trained["tokenizer"], None)
    assert first["alias"] == "champion" and first["version"] == 1, first["reason"]
    return cfg, name


def _challenger(trained) -> dict:
    return {"val_loss": 5.0, "step": 10, "checkpoint": trained[10],
            "task_metrics": {"hellaswag_acc": 0.25, "lambada_acc": 0.5}}


def test_forged_tags_pointing_at_a_planted_checkpoint_are_refused(trained, store, tmp_path):
    """Tags naming a planted checkpoint, with the content hash that matches it (and a run manifest
    beside it that lists it): the gate, a continued cycle and the model server's reload never read
    it, and the gate does not score it as the champion."""
    from infra.services.model_server.__main__ import version_resolver
    from tasks.continued.cycle import find_champion
    from tasks.core.hashing import sha256_file
    from tasks.deploy.registry import get_champion, model_content_hash
    from tasks.deploy.yardstick import against_champion

    cfg, name = _champion(trained, store, tmp_path)
    uri, marker = store["uri"], tmp_path / "PWNED"
    planted = tmp_path / "evil" / "train" / "checkpoints" / "step-000020"
    shutil.copytree(trained[20], planted)
    (planted / ".metadata").write_bytes(pickle.dumps(WritesMarker(str(marker))))  # what DCP unpickled
    files = {str(p.relative_to(planted)): sha256_file(p) for p in planted.rglob("*") if p.is_file()}
    (planted.parent / "checkpoints.json").write_text(json.dumps(
        {"checkpoints": [{"step": 20, "path": planted.name, "files": files, "train_loss": None, "val_loss": None,
                          "bytes": 0}]}))
    outsider = MlflowClient(tracking_uri=uri, registry_uri=uri)
    outsider.set_model_version_tag(name, "1", "checkpoint", str(planted))
    outsider.set_model_version_tag(name, "1", "content_hash", model_content_hash(planted, trained["tokenizer"]))

    data = against_champion(cfg, uri, _challenger(trained), trained["tokenizer"], get_champion(uri, name),
                            out_dir=tmp_path / "gate")
    assert not marker.exists(), "the planted pickle ran while the gate scored the champion"
    assert data["champion"]["checkpoint"] != str(planted) and str(planted) not in data["champion"]["scores"]
    champ = get_champion(uri, name)
    assert {"checkpoint", "content_hash"} <= set(champ["untrusted_tags"])
    assert "checkpoint" not in champ["tags"] and "content_hash" not in champ["tags"]
    # a continued cycle starts from the verified registered copy, never from the planted directory
    found = find_champion(cfg, uri)
    assert found.version == 1 and planted not in (found.checkpoint, *found.checkpoint.parents)
    ckpt, _, copy_hash, version = version_resolver(uri, name, tmp_path / "cache")(None, "champion")
    assert version == 1 and copy_hash and not ckpt.startswith(str(tmp_path / "evil"))
    assert not marker.exists()


def test_forged_yardstick_and_eval_tags_on_the_champion_are_not_used(trained, store, tmp_path):
    """The champion's cached scores on a set and its eval.* accuracies decide the gate: forged ones
    (rewritten, or added unsigned) are refused, and the champion is scored again."""
    from tasks.deploy.registry import get_champion
    from tasks.deploy.yardstick import against_champion

    cfg, name = _champion(trained, store, tmp_path)
    uri = store["uri"]
    first = against_champion(cfg, uri, _challenger(trained), trained["tokenizer"], get_champion(uri, name),
                             out_dir=tmp_path / "g1")
    sha = first["set"]["sha256"]
    again = against_champion(cfg, uri, _challenger(trained), trained["tokenizer"], get_champion(uri, name),
                             out_dir=tmp_path / "g2")
    assert again["set"]["sha256"] == sha and again["champion"]["scores"] == "reused from its registry tags"
    outsider = MlflowClient(tracking_uri=uri, registry_uri=uri)
    for part in first["champion"]["bits_per_byte"]:  # the champion made to look hopeless
        outsider.set_model_version_tag(name, "1", f"yardstick.{sha[:16]}.{part}", "99.0")
    outsider.set_model_version_tag(name, "1", "eval.hellaswag_acc", "0.0")
    outsider.set_model_version_tag(name, "1", "eval.lambada_acc", "0.0")  # a new, unsigned tag
    forged = against_champion(cfg, uri, _challenger(trained), trained["tokenizer"], get_champion(uri, name),
                              out_dir=tmp_path / "g3")
    assert forged["set"]["sha256"] == sha
    assert forged["champion"]["bits_per_byte"] == pytest.approx(first["champion"]["bits_per_byte"], abs=1e-6)
    assert forged["champion"]["scores"].startswith("scored from"), forged["champion"]["scores"]
    assert {c["part"]: c["champion"] for c in first["decision"]["checks"]}["hellaswag_acc"] == 0.3
    # a forged accuracy is not used, and not re-measured either: the gate refuses
    assert not any(c["champion"] == 0.0 for c in forged["decision"]["checks"])
    reason = forged["decision"]["reason"]
    assert not forged["decision"]["passed"] and "eval.hellaswag_acc" in reason and "eval.lambada_acc" in reason


def test_an_alias_moved_to_an_unsigned_version_is_refused(trained, store, tmp_path):
    """An outsider creates a version (even with every tag and signature of the champion copied onto
    it) and moves `champion` to it, or deletes the alias: the champion stays the version whose signed
    deployment.status says so, for the gate, a continued cycle and the model server's reload."""
    from infra.services.model_server.__main__ import version_resolver
    from tasks.continued.cycle import find_champion
    from tasks.deploy.registry import UnverifiedModel, get_champion, get_version

    cfg, name = _champion(trained, store, tmp_path)
    uri = store["uri"]
    outsider = MlflowClient(tracking_uri=uri, registry_uri=uri)
    real = outsider.get_model_version(name, "1")
    evil = tmp_path / "evil"
    evil.mkdir()
    mv = outsider.create_model_version(name, source=evil.as_uri(), run_id=real.run_id, tags=dict(real.tags))
    outsider.set_registered_model_alias(name, "champion", mv.version)
    assert get_champion(uri, name)["version"] == 1
    assert get_version(uri, name, alias="champion")["version"] == 1
    copied = get_version(uri, name, version=int(mv.version))
    assert copied["tags"] == {} and {"deployment.status", "content_hash", "checkpoint"} <= set(copied["untrusted_tags"])
    assert find_champion(cfg, uri).version == 1
    resolve = version_resolver(uri, name, tmp_path / "cache")
    assert resolve(None, "champion")[3] == 1
    with pytest.raises(UnverifiedModel):
        resolve(int(mv.version), None)
    outsider.delete_registered_model_alias(name, "champion")
    assert get_champion(uri, name)["version"] == 1
    # an alias other than champion counts only if the version's signed status names it
    outsider.set_registered_model_alias(name, "challenger", "1")
    with pytest.raises(LookupError):
        get_version(uri, name, alias="challenger")


def test_a_forged_token_index_is_not_used_by_continued_pretraining(trained, store, tmp_path):
    """data.tokens_index feeds a cycle's replay pool: a forged tag is refused, and an index (or a
    mix's pool member) rewritten in the run directory after signing is refused by its hash."""
    from tasks.continued.cycle import find_champion
    from tasks.continued.mix import MixError, replay_pool
    from tasks.core.hashing import sha256_file

    cfg, name = _champion(trained, store, tmp_path)
    uri = store["uri"]
    signed = find_champion(cfg, uri)
    assert signed.tokens_index is not None and signed.tokens_index.is_file()
    evil_pool = tmp_path / "evil-tokens.json"
    evil_pool.write_text("{}")
    evil = tmp_path / "evil-mix.json"
    evil.write_text(json.dumps({"mix": {"pool": [str(evil_pool)]}}))
    MlflowClient(tracking_uri=uri, registry_uri=uri).set_model_version_tag(name, "1", "data.tokens_index", str(evil))
    found = find_champion(cfg, uri)
    assert found.tokens_index is None and "data.tokens_index" not in found.tags
    # what the cycle replays: the forged tag's index, held to the champion's signed hash, is refused
    assert replay_pool(str(evil), found.tags.get("data.tokens_index_sha256") or "") == []

    # the run-directory writer: the signed hashes no longer match
    member, mix = tmp_path / "member.json", tmp_path / "mix.json"
    member.write_text('{"splits": {}}')
    mix.write_text(json.dumps({"mix": {"pool": [str(member)], "pool_sha256": {str(member): sha256_file(member)}}}))
    assert replay_pool(mix, sha256_file(mix)) == [member]
    assert replay_pool(mix, "0" * 64) == []  # the index is not the one signed
    member.write_text('{"splits": {"train": "elsewhere"}}')
    with pytest.raises(MixError, match="not the ones its mix recorded"):  # a member swapped after the mix was built
        replay_pool(mix, sha256_file(mix))


def test_planted_loader_code_in_the_registered_artifacts_never_runs(trained, store, tmp_path):
    """Registered versions carry no loader code: an outsider logs an MLmodel whose loader_module is
    their python file (and a pickle) into the champion's artifacts; verifying or loading the
    registered copy refuses it, and nothing planted runs."""
    from tasks.deploy.registry import UnverifiedModel, get_version, registered_files, verify_registered

    cfg, name = _champion(trained, store, tmp_path)
    uri, marker = store["uri"], tmp_path / "PWNED"
    outsider = MlflowClient(tracking_uri=uri, registry_uri=uri)
    mv = outsider.get_model_version(name, "1")
    module = f"planted_{uuid.uuid4().hex[:8]}"
    plant = tmp_path / "plant"
    (plant / "code").mkdir(parents=True)
    (plant / "code" / f"{module}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
        "def _load_pyfunc(path):\n    raise RuntimeError('planted')\n")
    (plant / "MLmodel").write_text(f"flavors:\n  python_function:\n    loader_module: {module}\n    code: code\n"
                                   "    python_version: 3.11.0\nmlflow_version: 3.17.2\n")
    (plant / "checkpoint").mkdir()
    (plant / "checkpoint" / ".metadata").write_bytes(pickle.dumps(WritesMarker(str(marker))))
    outsider.log_artifacts(mv.run_id, str(plant), mv.source.rsplit("/artifacts/", 1)[1])

    with pytest.raises(Exception, match="does not list|not the file"):
        verify_registered(uri, name, 1)
    assert not marker.exists(), "planted code ran while the registered copy was verified"
    from tasks.deploy.registry import load_registered

    with pytest.raises(UnverifiedModel):
        load_registered(uri, name, 1, registered_copy=True)
    # the champion's own files are gone: the registered copy is the only way, and it is refused
    found = get_version(uri, name, 1)
    gone = {**found, "tags": {**found["tags"], "checkpoint": str(tmp_path / "gone")}}
    with pytest.raises(UnverifiedModel):
        registered_files(uri, name, gone, tmp_path / "cache")
    assert not marker.exists()


def test_the_registered_token_index_hash_is_of_the_index_the_stack_signed(base, tmp_path):
    """Attack: a writer of the run folder (or the store) rewrites the token index before deploy, say
    to add a replay pool of its own. deploy's lineage tags hash the index as read then, and registry
    signs that hash: the next cycle would trust the rewritten index (replay_pool holds it to that
    hash). The index must be the one the tokens stage signed, else deploy refuses it."""
    from lm_helpers import random_checkpoint, tiny_cfg, tokenizer_artifact, tokens_artifact
    from tasks.core.hashing import sha256_file
    from tasks.core.signing import SignatureError
    from tasks.deploy import lineage_tags

    run = tmp_path / "r"
    shutil.copytree(Path(tokens_artifact(base)["index_path"]).parent, run / "tokens")
    index = run / "tokens" / "index.json"
    tok = Path(tokenizer_artifact(base)["path"])
    ckpt = random_checkpoint(run / "train", tok, 10, 1, meta_extra={"tokens_index": str(index)})
    evaluation = {"checkpoint": str(ckpt), "run_name": "test"}
    tags = lineage_tags(tiny_cfg(), evaluation, tok)
    assert tags["data.tokens_index"] == str(index) and tags["data.tokens_index_sha256"] == sha256_file(index)

    rewritten = json.loads(index.read_text())
    rewritten["mix"] = {"pool": [str(tmp_path / "planted" / "index.json")]}
    index.write_text(json.dumps(rewritten, indent=2))
    with pytest.raises(SignatureError):
        lineage_tags(tiny_cfg(), evaluation, tok)
