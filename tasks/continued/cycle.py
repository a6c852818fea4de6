"""One continued-pretraining cycle, as plain logic: the champion it continues (verified against the
registry), the checks that refuse a config that would not be a continuation, and the config the
cycle's stages run with (only the new files, the persistent MinHash index, training initialised
from the champion with a re-warmed schedule, or for a WSD champion from its pre-decay checkpoint
with a new stable-then-decay phase)."""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tasks.config import PipelineConfig
from tasks.continued.ledger import Discovery, under_state_dir
from tasks.core.storage import local_run_root

log = logging.getLogger(__name__)


class CycleError(ValueError):
    """A cycle that must not start; the message says why and what to change."""


@dataclass(frozen=True)
class Champion:
    """The registered champion a cycle continues, with its files verified."""
    model_name: str
    version: int
    checkpoint: Path | str  # an object-store run's: its URI
    checkpoint_sha256: str  # tree hash of the checkpoint directory (train.init_sha256)
    tokenizer: Path
    tokenizer_sha256: str
    tokens_index: Path | None  # what it was trained on (its replay pool comes from there)
    model: dict  # the checkpoint's GPTConfig
    run_name: str | None
    mlflow_run_id: str | None  # the run that registered it (training run)
    tags: dict

    def to_dict(self) -> dict:
        return {"model_name": self.model_name, "version": self.version, "checkpoint": str(self.checkpoint),
                "checkpoint_sha256": self.checkpoint_sha256, "tokenizer": str(self.tokenizer),
                "tokenizer_sha256": self.tokenizer_sha256,
                "tokens_index": str(self.tokens_index) if self.tokens_index else None, "run_name": self.run_name}


def find_champion(cfg: PipelineConfig, tracking_uri: str) -> Champion | None:
    """The champion of deploy.model_name, or None when there is none yet (the cycle bootstraps).
    Only its verified (signed) registry tags are used: a forged checkpoint, hash or token index tag
    is refused (tasks/deploy/registry.py), and its token index must hash to the signed value. Its
    checkpoint and tokenizer must hash to the registered content hash; when its checkpoint is
    gone (checkpoint retention, a cleaned run directory), the registered copy (weights only) is
    downloaded and verified against the hashes recorded at registration. Nothing unverified is
    loaded; a champion that cannot be verified refuses the cycle."""
    from tasks.continued.mix import verified_index
    from tasks.deploy.registry import UnverifiedModel, get_champion, registered_files
    from tasks.core import fs
    from tasks.core.storage import stored
    from tasks.train.checkpoint import read_meta

    found = get_champion(tracking_uri, cfg.deploy.model_name)
    if found is None:
        return None
    tags, version = found["tags"], found["version"]
    name = f"{cfg.deploy.model_name} version {version}"
    try:
        ckpt, tok, tree = registered_files(tracking_uri, cfg.deploy.model_name, found,
                                      local_run_root(cfg) / ".champions")
    except UnverifiedModel as e:
        raise CycleError(f"the champion ({name}) cannot be verified: {e}; promote another version") from None
    if str(ckpt) != tags.get("checkpoint"):
        log.warning("the champion's checkpoint %s is gone; continuing from its registered copy %s (weights only)",
                    tags.get("checkpoint"), ckpt)
        if cfg.continue_.init_optimizer:
            raise CycleError(f"continue.init_optimizer is true, but the champion's ({name}) own checkpoint "
                             f"{tags.get('checkpoint')} is gone and its registered copy holds the weights only: set "
                             "continue.init_optimizer=false")
    # tags are the verified ones (get_champion); the index itself must still hash to the signed value
    index = verified_index(tags.get("data.tokens_index"), tags.get("data.tokens_index_sha256"))
    meta = read_meta(*stored(ckpt))  # a checkpoint on a store: read there (the shape; training checks it again)
    # the hashes checked against the signed content hash: training must find those bytes (hashing the
    # files again here could hash others swapped in since)
    tok_sha = tags.get("tokenizer_sha256") or fs.sha256(*stored(tok))
    return Champion(cfg.deploy.model_name, version, ckpt, tree, tok, tok_sha,
                    index, meta["model"], tags.get("run_name"), found.get("run_id"), tags)


def check_continuation(cfg: PipelineConfig, champion: Champion) -> None:
    """Refuse, before anything starts, a config that would not continue the champion: one that asks
    to retrain the tokenizer, or a model shape other than the champion's (each differing field named)."""
    from tasks.train.checkpoint import shape_mismatch
    from tasks.train.model import GPTConfig

    if cfg.continue_.retrain_tokenizer:
        raise CycleError("continue.retrain_tokenizer is true, but a cycle keeps the champion's tokenizer "
                         f"({champion.tokenizer}, sha256 {champion.tokenizer_sha256[:12]}...): new token ids would "
                         "not mean what the champion learnt, so this would not be a continuation. Train a new "
                         "model with `crucible run` instead, or set continue.retrain_tokenizer=false")
    wanted = GPTConfig.from_model_config(cfg.model, champion.model["vocab_size"]).to_dict()
    if mismatch := shape_mismatch(champion.model, wanted, saved="champion"):
        raise CycleError(f"the config's model shape differs from the champion's ({champion.model_name} version "
                         f"{champion.version}): {'; '.join(mismatch)}; a cycle "
                         f"continues the champion's weights, so the model section must match them")


def pre_decay_checkpoint(champion: Champion) -> tuple[Path | str | None, str, str | None]:
    """(checkpoint, why, its tree hash from the signed manifest entry it verified against) for a WSD
    continuation: the champion's run's newest kept checkpoint at or
    before the step its decay began, verified file by file against the run's checkpoint manifest.
    None (with the reason) when the champion was not trained warmup-stable-decay or none is kept. A
    champion on a store is read there (its run's manifest and checkpoint objects)."""
    from tasks.core import fs
    from tasks.core.storage import stored
    from tasks.train.checkpoint import checkpoint_problem, entry_tree_sha256, read_manifest, read_meta

    at, options = stored(champion.checkpoint)
    meta = read_meta(at, options)
    schedule = meta.get("schedule") or {}
    if schedule.get("lr_schedule") != "wsd":
        return None, (f"the champion was trained with lr_schedule {schedule.get('lr_schedule', 'unrecorded')!r}, "
                      "not wsd"), None
    # never past the champion itself (a run's later checkpoints were not the ones gated and promoted)
    champion_step = int(meta.get("step", 0))
    train_dir, start = fs.parent_of(fs.parent_of(at)), int(schedule["decay_start"])
    manifest = read_manifest(train_dir, options)
    kept = [e for e in manifest["checkpoints"] if e["step"] <= min(start, champion_step)]
    if not kept:
        return None, (f"no checkpoint of the champion's run at or before step {start}, where its decay began, is "
                      f"kept in {train_dir} (train.checkpoint_every / keep_last_checkpoints decide what is kept)"), None
    entry = max(kept, key=lambda e: e["step"])
    ckpt = fs.join(fs.parent_of(champion.checkpoint), entry["path"])
    if checkpoint_problem(stored(ckpt)[0], manifest, storage_options=options):
        raise CycleError(f"the champion's pre-decay checkpoint {ckpt} does not match its run's checkpoint manifest: "
                         "refusing to continue from it")
    # the hash training must find comes from the signed entry just checked: reading the objects again
    # could hash others swapped in since (training would load those)
    return ckpt, (f"step {entry['step']} of the champion's run, the last kept before its decay began "
                  f"(step {start})"), entry_tree_sha256(manifest, entry["path"])


def minhash_index_dir(cfg: PipelineConfig, state_dir: str | Path) -> Path:
    """continue.minhash_index, relative to the stack's state directory unless absolute."""
    return under_state_dir(cfg.continue_.minhash_index, Path(state_dir).resolve())


def cycle_config(cfg: PipelineConfig, discovery: Discovery, champion: Champion | None,
                 state_dir: str | Path) -> PipelineConfig:
    """The config the cycle's stages run with: each source reduced to its new files (sources
    without any left out), MinHash deduplication against the persistent index (unless
    curate.dedup.minhash.index_dir names another), and with a champion: training from its
    checkpoint with the re-warmed cosine schedule and the cycle's step count."""
    new = defaultdict(list)
    for f in discovery.files:
        new[f.source].append(f.uri)
    data = cfg.model_dump(mode="json")
    data["sources"] = [dict(s, files=new[s["name"]]) for s in data["sources"] if new.get(s["name"])]
    if not data["sources"]:
        raise CycleError(discovery.message)
    minhash = data["curate"]["dedup"]["minhash"]
    if minhash["enabled"] and not minhash["index_dir"]:
        minhash["index_dir"] = str(minhash_index_dir(cfg, state_dir))
    if champion is not None:
        check_continuation(cfg, champion)
        c, train = cfg.continue_, data["train"]
        if c.replay_fraction > 0:
            from tasks.continued.mix import replay_pool
            from tasks.core import fs
            from tasks.core.storage import stored

            pool = replay_pool(champion.tokens_index, champion.tags.get("data.tokens_index_sha256") or "")
            # a member may be an object-store run's URI: asked on its store (Path(uri).is_file() is never true)
            missing = [str(p) for p in pool if not fs.is_file(*stored(p))]
            index = champion.tags.get("data.tokens_index")
            if not pool and index and fs.is_file(*stored(fs.location(index))):  # there, but not the signed bytes
                raise CycleError(f"continue.replay_fraction is {c.replay_fraction}, but the champion's token index "
                                 f"{index} was refused as changed (it does not hash to the champion's signed "
                                 "data.tokens_index_sha256), so nothing can be replayed: put back the index the "
                                 "champion was trained on, re-register the champion, or set continue.replay_fraction=0")
            if not pool or missing:
                raise CycleError(f"continue.replay_fraction is {c.replay_fraction}, but the champion's training tokens "
                                 f"({index if not pool else ', '.join(missing)}) are "
                                 "gone, so nothing can be replayed: restore them, or set continue.replay_fraction=0")
        start, why, start_sha256 = (None, "continue.lr_schedule is rewarm_cosine", None) \
            if c.lr_schedule == "rewarm_cosine" else pre_decay_checkpoint(champion)
        if start is None and c.lr_schedule == "wsd":
            raise CycleError(f"continue.lr_schedule is wsd, but {why}; use rewarm_cosine (or auto)")
        common = dict(init_optimizer=c.init_optimizer, resume=False, lr=c.lr or train["lr"],
                      max_steps=c.max_steps or train["max_steps"], stop_at_step=None)
        if start is not None:  # a new stable phase from before the champion's decay, then a decay
            train.update(init_from=str(start), init_sha256=start_sha256, lr_schedule="wsd",
                         warmup_steps=c.rewarm_steps or 0, **common)
        else:  # re-warm from the champion itself, then cosine re-decay
            train.update(init_from=str(champion.checkpoint), init_sha256=champion.checkpoint_sha256,
                         lr_schedule="cosine",
                         warmup_steps=train["warmup_steps"] if c.rewarm_steps is None else c.rewarm_steps, **common)
        log.info("cycle schedule: %s from %s (%s)", "wsd" if start is not None else "rewarm_cosine",
                 train["init_from"], why)
    # type(cfg): a config with the stack's sections (infra.settings.CrucibleConfig) keeps them
    return type(cfg).model_validate(data)
