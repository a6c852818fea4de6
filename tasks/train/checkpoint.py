"""Checkpoints with torch.distributed.checkpoint (DCP) in safetensors, as torchtitan does: nothing
in a checkpoint is ever unpickled.

Layout: out_dir/checkpoints/step-000100/ holds

    shard-XXXXX-model-00001-of-00001.safetensors   one per rank that wrote tensors (DCP's
        HuggingFaceStorageWriter, save_distributed): the tensors, or the shards of them, this rank
        saved, with each shard's offsets in the safetensors header (DCP_SHARDING_INFO, JSON);
    crucible_checkpoint.json   step, model config, vocab size, eos id, run ids and the trainer state
        (data loader position in global samples, skipped data ranges, the loss-spike windows),
        signed with the stack's key (purpose "checkpoint-meta", tasks/core/signing.py);
    rng/rank-XXXXX.json        per rank: torch, numpy, python and data-generator RNG states (JSON).

The tensors are {"model": model state (FQNs without the DDP "module." prefix), "optim": {"state":
AdamW moments per parameter FQN}, "train": {"step", "consumed_samples"}}, flattened by DCP to names
such as "model.tok_emb.weight" (the optimizer's param groups are rebuilt from the config). There is no
`.metadata` pickle: DCP's HuggingFaceStorageReader builds the load plan from the safetensors headers,
so DCP still reshards on load (a 2-rank FSDP2 save resumes on 1 rank, a dp_shard x tp one under 4-way
FSDP) and a planted file can at worst fail to parse. Everything else is JSON. The functions that take a
model take a rank's model parts too (its pipeline stages, each with its own optimizer in an
OptimizersContainer): their state dicts have disjoint FQNs, the full model's, and are merged, so a
checkpoint does not depend on the layout that wrote it.

Every file is still checked before it is read (`require_verified`): it must have the sha256 that its
run's manifest records (a directory the manifest does not list, or a file it does not list, is refused),
or, for a copy such as a registered export or a champion a continued run starts from, the tree hash
recorded for it. out_dir/checkpoints/checkpoints.json (the manifest, written by rank 0) lists every kept
checkpoint with its step, losses and the sha256 of each file, and is signed (purpose
"checkpoint-manifest"): only a process holding the stack's signing key can write a manifest that
verifies, so a writer of the run directory cannot vouch for a file by rewriting its hash (the manifest
and the meta file are refused as unsigned or forged, `UnverifiedCheckpoint`). `apply_retention` keeps
the last N and the best K. A checkpoint is written into step-XXXXXX.tmp and renamed once complete, so
a directory named step-XXXXXX is always whole.

On an object store (out_dir an fsspec URI such as s3://bucket/prefix/run/train; every function takes
`storage_options`, the fsspec options of `storage.options`): DCP writes the same safetensors files
through fsspec. A "rename" there copies every object, so a checkpoint is written in place, under
step-XXXXXX/, and its meta object (crucible_checkpoint.json), written last by rank 0 once every rank's
shards are there, publishes it: a prefix without it is absent to `list_checkpoints`,
`latest_checkpoint` and `checkpoint_problem`, and is cleared when that step is saved again (deleting
a checkpoint deletes its meta object first). Verifying reads the objects' bytes through fsspec;
loading (`verified_copy`) downloads the checkpoint into a temporary directory, verifies that copy and
hands DCP the copy, so the bytes read are the bytes verified (reading the store again after a check
would not be). The manifest is one object (one PUT), as is each meta file.

Async saving (train.async_checkpoint): `start_checkpoint(..., async_save=True)` copies the state
to CPU memory and returns while a background thread writes it (dcp.async_save, on a gloo group of
its own); `PendingCheckpoint.wait_and_finalize()` waits for the write and only then writes the meta
file and renames, so the rename stays the moment a checkpoint becomes visible.

`load_model_for_inference` works in a plain process without a process group; `save_model_copy`
writes a model-only copy (a registered model's files) in the same format.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Iterator

import numpy as np

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tasks.core.fs import (download, files, is_file, is_remote, join, link_or_copy, location, name_of, parent_of,
                           read_text, remove, remove_tree, resolve_storage_options, sha256, tree_sha256, write_text)
from tasks.core.io import atomic_write_text
from tasks.core.layout import CHECKPOINTS_DIR
from tasks.core.signing import SignatureError, dumps_signed, loads_signed
from tasks.core.storage import store_of_path
from tasks.train.model import GPT, GPTConfig
from tasks.train.torch_private import private

META_FILE = "crucible_checkpoint.json"
MANIFEST = "checkpoints.json"
RNG_DIR = "rng"
FORMAT = "dcp-safetensors"  # DCP's HuggingFaceStorageWriter files; before issue 24: a pickled .metadata
META_PURPOSE = "checkpoint-meta"  # signing purposes (tasks/core/signing.py)
MANIFEST_PURPOSE = "checkpoint-manifest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class UnverifiedCheckpoint(ValueError):
    """A checkpoint that must not be loaded: nothing trusted vouches for its files (a file differs
    from its manifest's hash, or the manifest or meta file is unsigned or forged)."""


def checkpoint_dir(out_dir: str | Path, step: int) -> Path | str:
    return join(location(out_dir), CHECKPOINTS_DIR, f"step-{step:06d}")


def list_checkpoints(out_dir: str | Path, storage_options: dict | None = None) -> list[Path | str]:
    """Complete (published) checkpoints under out_dir/checkpoints, oldest first: local Paths, or
    URIs for a remote out_dir."""
    root = join(location(out_dir), CHECKPOINTS_DIR)
    if is_remote(root):  # one listing of the prefix: the step-XXXXXX/ prefixes holding a meta object
        found = []
        for rel in files(root, storage_options):
            step_dir, _, rest = rel.partition("/")
            if rest == META_FILE and (m := _STEP_DIR.match(step_dir)):
                found.append((int(m.group(1)), join(root, step_dir)))
        return [p for _, p in sorted(found)]
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / META_FILE).is_file()]
    return [p for _, p in sorted(found)]


def read_meta(ckpt_dir: str | Path, storage_options: dict | None = None) -> dict:
    """The checkpoint's meta file, once its signature verifies (UnverifiedCheckpoint otherwise: a
    meta file is trusted for the model's shape, the loop's state and the tokenizer's hash)."""
    path = join(location(ckpt_dir), META_FILE)
    try:
        return loads_signed(read_text(path, storage_options), META_PURPOSE, what=f"checkpoint meta file {path}")
    except (SignatureError, UnicodeDecodeError) as e:  # not even text: refused like any unsigned record
        raise UnverifiedCheckpoint(f"refusing the checkpoint {location(ckpt_dir)}: {e}") from e


def trained_index_problem(meta: dict, index_sha256: str, index: dict | None = None) -> str | None:
    """Why a signed token index (`index_sha256`: the hash of its bytes as read and verified) is not the
    one the checkpoint whose signed `meta` this is was trained from, or None when it is. A signature
    does not tie an index to its run: run A's genuine signed index copied into run B's tokens/ verifies,
    and B's checkpoints would be scored on A's held-out set. The trainer records the sha256 of the index
    bytes it read (tokens_index_sha256) and of that index's val split (tokens_val_sha256). With `index`
    (a reader of the held-out split) an index holding that val split is also the one: a continued
    cycle trains on its mix, which holds out the cycle's own tokens' val split, and evaluation reads
    that. A checkpoint written before the trainer recorded the hash has neither field: its index is held
    to the signature only, as before (old checkpoints keep working)."""
    want = meta.get("tokens_index_sha256")
    if not want or index_sha256 == want:
        return None
    val = ((index or {}).get("splits") or {}).get("val") or {}
    if index is not None and meta.get("tokens_val_sha256") and val.get("sha256") == meta["tokens_val_sha256"]:
        return None
    return (f"not the token index checkpoint step {meta.get('step')} of run {meta.get('run_name')!r} was trained "
            f"from (sha256 {index_sha256[:16]}..., its signed meta records {want[:16]}...): another run's index?")


def remove_checkpoint(ckpt_dir: str | Path, storage_options: dict | None = None, ignore_errors: bool = True) -> None:
    """Delete a checkpoint. On a store its meta object goes first, so no reader ever sees a
    published checkpoint with missing files."""
    ckpt_dir = location(ckpt_dir)
    if not is_remote(ckpt_dir):
        shutil.rmtree(ckpt_dir, ignore_errors=ignore_errors)
        return
    remove(join(ckpt_dir, META_FILE), storage_options)
    remove_tree(ckpt_dir, storage_options)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


ModelParts = "nn.Module | list[nn.Module]"  # one module, or a rank's model parts (pipeline stages)


def _parts(model) -> list[nn.Module]:
    """A rank's model parts: under pipeline parallelism several modules (one per stage it holds) whose
    state dicts have disjoint FQNs and merge into the model's; else the one model."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _optimizers(optimizer, n: int) -> list[torch.optim.Optimizer]:
    """The per-part optimizers of `optimizer` (an OptimizersContainer, tasks/train/optimizer.py, holds one
    per model part; a plain optimizer serves a single part)."""
    optims = list(getattr(optimizer, "optimizers", None) or [optimizer])
    if len(optims) != n:
        raise ValueError(f"{len(optims)} optimizer(s) for {n} model part(s)")
    return optims


def model_state(model) -> dict:
    """The model's state dict (DTensor shards under FSDP2 / TP), merged over the rank's parts."""
    out: dict = {}
    for part in _parts(model):
        out.update(get_model_state_dict(part))
    return out


def _optim_states(model, optimizer) -> list[dict]:
    """Per part: get_optimizer_state_dict (FQN-keyed AdamW moments, initialised if still empty)."""
    parts = _parts(model)
    return [get_optimizer_state_dict(part, opt) for part, opt in zip(parts, _optimizers(optimizer, len(parts)))]


def _set_states(model, optimizer, model_sd: dict, optim_state: dict | None, osds: list[dict] | None) -> None:
    """Load a merged model state (and optimizer moments) into each part, each taking its own FQNs."""
    parts = _parts(model)
    for i, part in enumerate(parts):
        own = get_model_state_dict(part).keys()
        set_model_state_dict(part, {k: model_sd[k] for k in own})
        if optim_state is not None:
            opt = _optimizers(optimizer, len(parts))[i]
            mine = {k: optim_state[k] for k in osds[i]["state"]}
            set_optimizer_state_dict(part, opt, {"state": mine, "param_groups": osds[i]["param_groups"]},
                                     options=StateDictOptions(strict=True))


def _merged(osds: list[dict]) -> dict:
    return {k: v for osd in osds for k, v in osd["state"].items()}


def new_checkpoint_group() -> "dist.ProcessGroup | None":
    """Collective (every rank, same point): a gloo group of all ranks for asynchronous saves.

    The writer thread of an async save runs DCP's collectives (plan gather, finish) while the main
    thread runs training all-reduces; on one shared group the two streams of collectives would
    interleave differently on each rank, so async saves get a group of their own (as torchtitan
    does). None when no process group is initialised (single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


class PendingCheckpoint:
    """A checkpoint being written into step-XXXXXX.tmp; `wait_and_finalize` makes it visible.

    Finalising (rank 0 writes the meta file and renames .tmp to the final name, then all ranks
    meet at a barrier) happens only after DCP has written every rank's shards, so a directory
    named step-XXXXXX is always complete. On an object store tmp is final: the meta object, written
    last, publishes it. Collective: every rank calls it at the same point.
    blocked_s: time the caller was blocked starting the save (for a sync save: the whole write);
    write_s: from start until this rank's write finished; total_s: from start until finalised."""

    def __init__(self, step: int, tmp: Path | str, final: Path | str, meta_json: str, future=None,
                 started: float = 0.0, blocked_s: float = 0.0, storage_options: dict | None = None):
        self.step, self.tmp, self.final = step, tmp, final
        self.storage_options = storage_options
        self._meta_json, self._future = meta_json, future
        self.started, self.blocked_s = started, blocked_s
        self.write_s: float | None = None if future is not None else blocked_s
        self.total_s: float | None = None
        self.path: Path | str | None = None
        if future is not None:
            future.add_done_callback(lambda _: setattr(self, "write_s", time.perf_counter() - started))

    @property
    def is_async(self) -> bool:
        return self._future is not None

    def done(self) -> bool:
        """True when this rank's write has finished (finalising still has to be called)."""
        return self._future is None or self._future.done()

    def wait_and_finalize(self) -> Path | str:
        """Wait for the write (re-raising its error), then publish the checkpoint. Idempotent."""
        if self.path is not None:
            return self.path
        if self._future is not None:
            self._future.result()  # DCP returns once the global metadata of all ranks is written
            if self.write_s is None:  # done-callbacks may run just after result() returns
                self.write_s = time.perf_counter() - self.started
        if _rank() == 0 and is_remote(self.final):  # written in place: this object publishes it
            write_text(join(self.final, META_FILE), self._meta_json, self.storage_options)
        elif _rank() == 0:
            (self.tmp / META_FILE).write_text(self._meta_json)
            if self.final.exists():  # a rerun of the same out_dir without resume
                shutil.rmtree(self.final)
            self.tmp.rename(self.final)
        _barrier()
        self.total_s = time.perf_counter() - self.started
        self.path = self.final
        return self.final


def start_checkpoint(model: ModelParts, optimizer: torch.optim.Optimizer, step: int,
                     out_dir: str | Path, meta: dict, rng_state: dict | None = None,
                     async_save: bool = False, process_group: "dist.ProcessGroup | None" = None,
                     storage_options: dict | None = None) -> PendingCheckpoint:
    """Collective: every rank calls it. Starts writing the checkpoint of `step`.

    Sync (async_save False): the DCP write is done when this returns. Async: the state is first
    copied to CPU memory (dcp.async_save's staging, so later optimizer steps cannot change what
    is saved) and written by a background thread; `process_group` must then be a group of its
    own (see `new_checkpoint_group`) when a process group is initialised. The meta (and the
    trainer state in it) is serialised now, so later changes to the dicts do not leak in either.
    Call `wait_and_finalize()` on the result before the next save and before the process ends."""
    started = time.perf_counter()
    distributed = dist.is_available() and dist.is_initialized()
    if async_save and distributed and process_group is None:
        raise ValueError("async checkpoint saving needs its own process group (new_checkpoint_group()): "
                         "the default group also carries the training collectives")
    final = checkpoint_dir(out_dir, step)
    remote = is_remote(final)
    # an object store has no rename (it would copy every object): written in place, published by the meta
    tmp = final if remote else final.with_name(final.name + ".tmp")
    rank = _rank()
    if rank == 0 and remote:  # an older checkpoint of this step (a rollback redoes steps) or a crash's leftovers
        remove_checkpoint(final, storage_options)
    elif rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / RNG_DIR).mkdir(parents=True)
    _barrier()
    if rng_state is not None:
        write_text(join(tmp, RNG_DIR, f"rank-{rank:05d}.json"), json.dumps(rng_state), storage_options)
    meta_json = dumps_signed({**meta, "format": FORMAT, "step": step}, META_PURPOSE)
    consumed = int((meta.get("trainer") or {}).get("consumed_samples", 0))
    state = {
        "model": model_state(model),
        "optim": {"state": _merged(_optim_states(model, optimizer))},
        "train": {"step": torch.tensor(step, dtype=torch.int64),
                  "consumed_samples": torch.tensor(consumed, dtype=torch.int64)},
    }
    future = None
    target = _dcp_target(tmp, storage_options)
    if async_save:
        future = dcp.async_save(state, process_group=process_group, **target)
    else:
        dcp.save(state, **target)  # returns on every rank once the metadata is written
    return PendingCheckpoint(step, tmp, final, meta_json, future, started,
                             blocked_s=time.perf_counter() - started, storage_options=storage_options)


def _dcp_target(ckpt_dir: Path | str, storage_options: dict | None) -> dict:
    """dcp.save's destination: DCP's HuggingFaceStorageWriter (safetensors, no pickled .metadata) into a
    local directory or, through fsspec, onto the store. save_distributed: every rank writes the tensors
    (or DTensor shards) it owns into a file of its own, the shards' offsets in the file's JSON header, so
    the reader can reshard; nothing is consolidated (the weights' names are not Hugging Face's anyway:
    tasks/deploy/export.py maps them). No checkpoint_id beside it: DCP would re-open the path without
    the storage options."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    if not is_remote(ckpt_dir):
        return {"storage_writer": HuggingFaceStorageWriter(str(ckpt_dir), save_distributed=True)}
    FileSystem = private("FileSystem")  # not re-exported by the package

    writer = HuggingFaceStorageWriter(ckpt_dir, save_distributed=True)
    writer.fs = FileSystem()  # as DCP's FsspecWriter does for its torch.save files
    writer.path = writer.fs.init_path(ckpt_dir, **resolve_storage_options(storage_options))
    # not fsynced there: an object is durable once its PUT returns (DCP would run os.sync() per file)
    writer.sync_files = False
    return {"storage_writer": writer}


def _dcp_load(state: dict, local: Path, ckpt_dir: str | Path, no_dist: bool = False) -> None:
    """dcp.load of a verified local copy with DCP's HuggingFaceStorageReader: the load plan comes from
    the safetensors files' JSON headers, never from a pickle. A file that does not parse raises
    ValueError (DCP's CheckpointException is a BaseException, which callers that handle a bad
    checkpoint, such as the model server's reload, would not catch)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.api import CheckpointException

    split_back = fused_qkv_to_split(state, _saved_names(local))
    try:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(local)), no_dist=no_dist)
    except CheckpointException as e:
        raise ValueError(f"the checkpoint {ckpt_dir} could not be read: {e}") from None
    split_back()


def _saved_names(local: Path) -> set[str]:
    """The flattened tensor names a (verified, local) checkpoint holds: its safetensors headers only."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in Path(local).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            names.update(st.keys())
    return names


# Before commit 7dfb9a8 attention had one fused projection `attn.qkv` (3*d_model rows), whose forward
# split its output as qkv(x).split(d_model) -> q, k, v: rows [0, C) are wq's, [C, 2C) wk's, [2C, 3C) wv's.
_SPLIT_NAMES = ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight")
_FUSED_NAME = "attn.qkv.weight"


def fused_qkv_to_split(state: dict, saved: set[str]):
    """The one conversion of old-format checkpoints, for every loader (resume, continued pretraining,
    evaluation, serving, export all read through `_dcp_load`): where `state` (the nested dict DCP
    loads into) asks for `...attn.wq/wk/wv.weight` (or their AdamW moments) and the checkpoint holds
    the fused `...attn.qkv.weight` instead, the three entries are replaced in place by one whole
    (unsharded) tensor for the fused name. Returns the function to call after dcp.load: it splits the
    loaded rows (q, k, v order) back into the original targets, resharding into DTensor targets (FSDP
    / TP) locally, and restores `state`'s entries. A new-format checkpoint is left alone (a no-op).
    The files were verified before this reads them; only names change, never what is trusted."""
    fills: list[tuple[tuple, torch.Tensor]] = []

    def template(targets: tuple):
        if isinstance(targets[0], dict):  # an AdamW state: exp_avg, exp_avg_sq, step
            return {k: template(tuple(t[k] for t in targets)) for k in targets[0]}
        if targets[0].dim() == 0:  # AdamW's step count: one scalar, the same for the three
            full = torch.empty((), dtype=targets[0].dtype)
        else:  # global shapes (a DTensor's .shape is the whole tensor's)
            full = torch.empty((sum(t.shape[0] for t in targets), *targets[0].shape[1:]), dtype=targets[0].dtype)
        fills.append((targets, full))
        return full

    def walk(d: dict, prefix: str) -> list:
        restore = []
        for key in list(d):
            if key not in d:  # a wk/wv entry this loop already fused
                continue
            if isinstance(d[key], dict):
                restore += walk(d[key], f"{prefix}{key}.")
            if not key.endswith(_SPLIT_NAMES[0]):
                continue
            stem = key[: -len(_SPLIT_NAMES[0])]
            fused = f"{prefix}{stem}{_FUSED_NAME}"
            names = [stem + n for n in _SPLIT_NAMES]
            if all(n in d for n in names) and any(s == fused or s.startswith(fused + ".") for s in saved):
                targets = tuple(d.pop(n) for n in names)
                d[stem + _FUSED_NAME] = template(targets)
                restore.append((d, stem, names, targets))
        return restore

    restore = walk(state, "")

    def split_back() -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        with torch.no_grad():
            for targets, full in fills:
                parts = [full] * 3 if full.dim() == 0 else full.split([t.shape[0] for t in targets])
                for t, part in zip(targets, parts):
                    if isinstance(t, DTensor):  # this rank's shard of the whole part, cut locally (no comms)
                        part = distribute_tensor(part.to(t.to_local().device), t.device_mesh, t.placements,
                                                 src_data_rank=None).to_local()
                        t = t.to_local()
                    t.copy_(part)
        for d, stem, names, targets in restore:
            del d[stem + _FUSED_NAME]
            d.update(zip(names, targets))

    return split_back


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    out_dir: str | Path, meta: dict, rng_state: dict | None = None,
                    storage_options: dict | None = None) -> Path | str:
    """Collective: every rank calls it. Blocking save; returns the final checkpoint directory.

    rng_state: this rank's RNG states (see `capture_rng_state`), written to rng/rank-XXXXX.json.
    """
    return start_checkpoint(model, optimizer, step, out_dir, meta, rng_state,
                            storage_options=storage_options).wait_and_finalize()


@contextmanager
def verified_copy(ckpt_dir: str | Path, storage_options: dict | None = None,
                  expected_tree_sha256: str | None = None) -> Iterator[tuple[Path, str]]:
    """`ckpt_dir`, verified (`require_verified`), as a local directory DCP may read. A local one is
    verified as a private copy (hard links); one on an object store is first downloaded into a
    temporary directory (removed afterwards) and that copy is verified, against the run's (signed) manifest on the store or `expected_tree_sha256`: the bytes DCP
    then reads are the bytes that were verified. Yields (the local copy, its tree hash): the hash of
    the bytes verified, for a record of what was loaded (hashing the source again could see other bytes)."""
    ckpt_dir = location(ckpt_dir)
    if not is_remote(ckpt_dir):
        # verify and load a private copy, so the files cannot change between the check and DCP's read:
        # a writer of the run directory replaces a file by renaming another into place, which leaves
        # the linked bytes as they were. Hard links
        # beside the checkpoint (a copy where links cannot be made), in a 0700 folder of this process
        store = store_of_path(ckpt_dir)
        manifest = None if expected_tree_sha256 else read_manifest(Path(ckpt_dir).parent.parent)
        with _private_dir(store.cache_dir if store is not None else _run_train_dir(ckpt_dir)) as tmp:
            local = Path(tmp) / Path(ckpt_dir).name
            shutil.copytree(ckpt_dir, local, ignore=shutil.ignore_patterns(".tmp-*"),  # a partial download
                            copy_function=link_or_copy)
            if problem := checkpoint_problem(local, manifest, expected_tree_sha256):
                raise UnverifiedCheckpoint("refusing to load a checkpoint that does not verify: "
                                           + problem.replace(str(local), str(ckpt_dir)))
            yield local, expected_tree_sha256 or entry_tree_sha256(manifest, Path(ckpt_dir).name)
        return
    manifest = None if expected_tree_sha256 else read_manifest(parent_of(parent_of(ckpt_dir)), storage_options)
    with tempfile.TemporaryDirectory(prefix="crucible-checkpoint-") as tmp:
        local = download(ckpt_dir, Path(tmp) / name_of(ckpt_dir), storage_options)
        if problem := checkpoint_problem(local, manifest, expected_tree_sha256):
            raise UnverifiedCheckpoint("refusing to load a checkpoint that does not verify: "
                                       + problem.replace(str(local), ckpt_dir))
        yield local, expected_tree_sha256 or entry_tree_sha256(manifest, name_of(ckpt_dir))


def _run_train_dir(ckpt_dir: Path | str) -> Path | None:
    """The training output folder of a run's checkpoint (out_dir/checkpoints/step-N), else None."""
    ckpt_dir = Path(ckpt_dir)
    return ckpt_dir.parent.parent if ckpt_dir.parent.name == CHECKPOINTS_DIR else None


_PRIVATE_PREFIX = ".crucible-verified-"  # + the loading process's pid


def _sweep_private_dirs(beside: Path) -> None:
    """Remove private copies a killed loader left (their hard links would keep the bytes of
    checkpoints that retention deleted)."""
    for d in beside.glob(f"{_PRIVATE_PREFIX}*"):
        pid = d.name[len(_PRIVATE_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


@contextmanager
def _private_dir(beside: Path | str | None) -> Iterator[str]:
    """A temporary 0700 folder in `beside` (hard links need the same file system), else in the
    system's temporary folder (then files are copied)."""
    try:
        if beside is None:
            raise OSError
        _sweep_private_dirs(Path(beside))
        tmp = tempfile.TemporaryDirectory(prefix=f"{_PRIVATE_PREFIX}{os.getpid()}-", dir=beside)
    except OSError:
        tmp = tempfile.TemporaryDirectory(prefix="crucible-verified-")
    with tmp as path:
        yield path


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt_dir: str | Path,
                    storage_options: dict | None = None) -> int:
    """Collective resume: load model and optimizer state in place; returns the checkpoint's step.

    DCP reshards on load, so the world size may differ from the one that saved. The checkpoint
    must verify against its run's manifest first."""
    return restore_checkpoint(model, optimizer, ckpt_dir, storage_options=storage_options)[0]


def restore_checkpoint(model: ModelParts, optimizer: torch.optim.Optimizer, ckpt_dir: str | Path,
                       rank: int | None = None, storage_options: dict | None = None
                       ) -> tuple[int, dict, dict | None]:
    """`load_checkpoint`, also returning the meta and (with `rank`) that rank's RNG states, read from
    the same verified copy as the tensors (a file read again afterwards might no longer be the one
    verified): (step, meta, rng or None)."""
    with verified_copy(ckpt_dir, storage_options) as (local, _):
        meta = read_meta(local)
        rng = read_rng_state(local, rank) if rank is not None else None
        osds = _optim_states(model, optimizer)  # initialises moments so shapes are known
        state = {
            "model": model_state(model),
            "optim": {"state": _merged(osds)},
            "train": {"step": torch.tensor(0, dtype=torch.int64)},
        }
        _dcp_load(state, local, ckpt_dir)
    _set_states(model, optimizer, state["model"], state["optim"]["state"], osds)
    return int(state["train"]["step"]), meta, rng


def shape_mismatch(saved_model: dict, model: dict, saved: str = "checkpoint") -> list[str]:
    """The model fields (GPTConfig) on which a saved model differs from `model`, as
    "model.d_model: checkpoint 128, config 256" ([] when the weights fit); `saved` names the saved side."""
    return [f"model.{k}: {saved} {saved_model.get(k)!r}, config {model.get(k)!r}"
            for k in sorted(set(saved_model) | set(model)) if saved_model.get(k) != model.get(k)]


def init_from_checkpoint(model: ModelParts, optimizer: torch.optim.Optimizer, ckpt_dir: str | Path,
                         tree_sha256: str, with_optimizer: bool = False, storage_options: dict | None = None) -> dict:
    """Collective: a fresh run starts from `ckpt_dir`'s model weights (and, with_optimizer, its AdamW
    moments); its step counter, data position and schedule are not taken over.

    The directory's tree hash must equal `tree_sha256` before DCP reads it, its meta file must be
    signed, and the checkpoint's model shape (in that meta) must equal `model`'s. Returns the meta."""
    ckpt_dir = location(ckpt_dir)
    if not is_file(join(ckpt_dir, META_FILE), storage_options):
        raise FileNotFoundError(f"{ckpt_dir} is not a complete checkpoint (no {META_FILE})")
    with verified_copy(ckpt_dir, storage_options, tree_sha256) as (local, _):
        meta = read_meta(local)
        if mismatch := shape_mismatch(meta["model"], _parts(model)[0].cfg.to_dict()):
            raise ValueError(f"the checkpoint {ckpt_dir} has another model shape: {'; '.join(mismatch)}")
        state: dict = {"model": model_state(model)}
        osds = None
        if with_optimizer:
            osds = _optim_states(model, optimizer)
            state["optim"] = {"state": _merged(osds)}
        _dcp_load(state, local, ckpt_dir)
    _set_states(model, optimizer, state["model"], state["optim"]["state"] if osds else None, osds)
    return meta


def checkpoint_tensors(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a local checkpoint, whole, by DCP's flattened name ("model.tok_emb.weight",
    "optim.state.tok_emb.weight.exp_avg", "train.step"): the safetensors files read directly (not
    through DCP's loader), each rank's shards placed at the offsets in their header. For inspection and
    tests; it verifies nothing (safetensors and JSON only, so a bad file can at worst fail to parse)."""
    from safetensors import safe_open
    CUSTOM_METADATA_KEY, SAVED_OFFSETS_KEY = private("CUSTOM_METADATA_KEY"), private("SAVED_OFFSETS_KEY")

    parts: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            sharding = json.loads((st.metadata() or {}).get(CUSTOM_METADATA_KEY) or "{}")
            for key in st.keys():
                t = st.get_tensor(key)
                parts.setdefault(key, []).append(((sharding.get(key) or {}).get(SAVED_OFFSETS_KEY) or [0] * t.dim(), t))
    out = {}
    for key, shards in parts.items():
        size = [max(o[i] + t.shape[i] for o, t in shards) for i in range(shards[0][1].dim())]
        out[key] = full = torch.empty(size, dtype=shards[0][1].dtype)
        for o, t in shards:
            full[tuple(slice(a, a + n) for a, n in zip(o, t.shape))] = t
    return out


def weights_sha256(model, pp_group: "dist.ProcessGroup | None" = None) -> str:
    """sha256 over the model's parameters and buffers in name order (full tensors under FSDP2 / TP):
    equal for bitwise-equal weights, whatever the layout. `model`: a module, or a rank's model parts.
    Under pipeline parallelism a rank holds only its stages: with `pp_group` (the "pp" mesh group) the
    stages of the group's other ranks are gathered, so the hash is of the whole model (collective)."""
    state = {}
    for part in _parts(model):
        for name, t in get_model_state_dict(part).items():
            state[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()
    if pp_group is not None:
        gathered: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, state, group=pp_group)
        state = {name: t for got in gathered for name, t in got.items()}
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ---------------------------------------------------------------- RNG states (JSON, per rank)

def capture_rng_state(data_rng: np.random.Generator | None = None) -> dict:
    """This process's torch (CPU and, if used, CUDA), numpy global, python and data RNG states."""
    np_state = np.random.get_state()
    out = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    if data_rng is not None:
        out["data"] = data_rng.bit_generator.state
    return out


def restore_rng_state(state: dict, data_rng: np.random.Generator | None = None) -> None:
    raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))
    if "cuda" in state and torch.cuda.is_available():
        raw = np.frombuffer(base64.b64decode(state["cuda"]), dtype=np.uint8).copy()
        torch.cuda.set_rng_state(torch.from_numpy(raw))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if data_rng is not None and "data" in state:
        data_rng.bit_generator.state = state["data"]


def read_rng_state(ckpt_dir: str | Path, rank: int, storage_options: dict | None = None) -> dict | None:
    """This rank's saved RNG states, or None (e.g. resuming on more ranks than saved)."""
    path = join(location(ckpt_dir), RNG_DIR, f"rank-{rank:05d}.json")
    return json.loads(read_text(path, storage_options)) if is_file(path, storage_options) else None


# ---------------------------------------------------------------- manifest and retention

def read_manifest(out_dir: str | Path, storage_options: dict | None = None) -> dict:
    """The run's checkpoint manifest ({"checkpoints": []} when there is none yet), once its signature
    verifies; UnverifiedCheckpoint when it is unsigned or forged (then nothing it lists is loaded)."""
    path = join(location(out_dir), CHECKPOINTS_DIR, MANIFEST)
    if not is_file(path, storage_options):
        return {"checkpoints": []}
    try:
        return loads_signed(read_text(path, storage_options), MANIFEST_PURPOSE, what=f"checkpoint manifest {path}")
    except (SignatureError, UnicodeDecodeError) as e:
        raise UnverifiedCheckpoint(f"refusing every checkpoint of {location(out_dir)}: {e}") from e


def _write_manifest(out_dir: str | Path, manifest: dict, storage_options: dict | None = None) -> None:
    path, text = join(location(out_dir), CHECKPOINTS_DIR, MANIFEST), dumps_signed(manifest, MANIFEST_PURPOSE)
    if is_remote(path):
        write_text(path, text, storage_options)
    else:
        atomic_write_text(path, text, fsync=False)


def checkpoint_entry(ckpt_dir: str | Path, storage_options: dict | None = None) -> dict:
    ckpt_dir = location(ckpt_dir)
    meta = read_meta(ckpt_dir, storage_options)
    found = files(ckpt_dir, storage_options)  # on a store: each object's bytes are read back to hash them
    return {
        "step": meta["step"],
        "path": name_of(ckpt_dir),
        "train_loss": meta.get("train_loss"),
        "val_loss": meta.get("val_loss"),
        "files": {f: sha256(join(ckpt_dir, f), storage_options) for f in found},
        "bytes": sum(found.values()),
    }


def _score(entry: dict) -> float:
    v = entry.get("val_loss")
    v = entry.get("train_loss") if v is None else v
    return float("inf") if v is None else float(v)


def apply_retention(out_dir: str | Path, new_ckpt: str | Path | None, keep_last: int | None,
                    keep_best: int = 0, storage_options: dict | None = None) -> dict:
    """Rank 0 only: add new_ckpt to the manifest (with sha256 per file), then delete checkpoints
    that are neither among the keep_last newest nor the keep_best best (by val loss where every
    candidate has one, else train loss). The newest is always kept. Returns the manifest."""
    manifest = read_manifest(out_dir, storage_options)
    entries = {e["step"]: e for e in manifest["checkpoints"]}
    on_disk = {int(name_of(p).split("-")[1]): p for p in list_checkpoints(out_dir, storage_options)}
    entries = {s: e for s, e in entries.items() if s in on_disk}
    # only the checkpoint this run just wrote joins the manifest: a directory that appeared some other
    # way (or one a crash left unlisted) is never vouched for, so it is never loaded
    if new_ckpt is not None and name_of(new_ckpt) in {name_of(p) for p in on_disk.values()}:
        step = next(s for s, p in on_disk.items() if name_of(p) == name_of(new_ckpt))
        entries[step] = checkpoint_entry(on_disk[step], storage_options)
    steps = sorted(entries)
    keep = set(steps[-keep_last:]) if keep_last else set(steps)
    if steps:
        keep.add(steps[-1])
    if keep_best and steps:
        use_val = all(entries[s].get("val_loss") is not None for s in steps)
        key = (lambda s: entries[s]["val_loss"]) if use_val else (lambda s: _score(entries[s]))
        best = sorted(steps, key=key)[:keep_best]
        keep |= set(best)
        for s in steps:
            entries[s]["best"] = s in best
    for s in steps:
        if s not in keep:
            remove_checkpoint(on_disk[s], storage_options)
            del entries[s]
    manifest = {"checkpoints": [entries[s] for s in sorted(entries)],
                "keep_last": keep_last, "keep_best": keep_best}
    _write_manifest(out_dir, manifest, storage_options)
    return manifest


def manifest_tree_sha256(ckpt_dir: str | Path, storage_options: dict | None = None) -> str | None:
    """The checkpoint's tree hash (tasks.core.fs.tree_sha256) from the file hashes its run's signed
    manifest records, no object read; None when the manifest does not list it (or does not verify)."""
    ckpt_dir = location(ckpt_dir)
    try:
        manifest = read_manifest(parent_of(parent_of(ckpt_dir)), storage_options)
    except UnverifiedCheckpoint:
        return None
    return entry_tree_sha256(manifest, name_of(ckpt_dir))


def entry_tree_sha256(manifest: dict, name: str) -> str | None:
    """The tree hash of checkpoint `name` from the file hashes `manifest` lists (None if unlisted): once a
    copy verified against the manifest (every file listed, each with its hash), the copy's tree hash."""
    from tasks.core.hashing import tree_digest

    entry = next((e for e in manifest["checkpoints"] if e["path"] == name), None)
    if entry is None:
        return None
    return tree_digest(sorted(entry["files"].items(), key=lambda kv: PurePosixPath(kv[0]).parts))


def checkpoint_problem(ckpt_dir: str | Path, manifest: dict | None = None,
                       expected_tree_sha256: str | None = None, storage_options: dict | None = None) -> str | None:
    """Why `ckpt_dir` must not be loaded, or None when it verifies: with `expected_tree_sha256`,
    its tree hash must equal it; else its run's manifest (checkpoints.json beside it) must list it
    and every file on disk must be one it lists, with its sha256; the manifest must be signed. On a
    store the objects' bytes are read through fsspec."""
    ckpt_dir = location(ckpt_dir)
    if not is_file(join(ckpt_dir, META_FILE), storage_options):
        return f"{ckpt_dir} is not a complete checkpoint (no {META_FILE})"
    if expected_tree_sha256 is not None:
        actual = tree_sha256(ckpt_dir, storage_options)
        return None if actual == expected_tree_sha256 else (
            f"{ckpt_dir} has content hash {actual[:16]}..., not the recorded {expected_tree_sha256[:16]}...")
    if manifest is None:
        try:
            manifest = read_manifest(parent_of(parent_of(ckpt_dir)), storage_options)
        except UnverifiedCheckpoint as e:
            return str(e)
    entry = next((e for e in manifest["checkpoints"] if e["path"] == name_of(ckpt_dir)), None)
    if entry is None:
        return f"{ckpt_dir} is not listed in its run's checkpoint manifest ({CHECKPOINTS_DIR}/{MANIFEST})"
    on_disk = files(ckpt_dir, storage_options)
    if extra := sorted(set(on_disk) - set(entry["files"])):
        return f"{ckpt_dir} holds files its manifest does not list: {extra[:3]}"
    for f, h in entry["files"].items():
        if f not in on_disk or sha256(join(ckpt_dir, f), storage_options) != h:
            return f"{join(ckpt_dir, f)} does not have the sha256 its manifest records"
    return None


def verify_checkpoint(ckpt_dir: str | Path, manifest: dict | None = None, storage_options: dict | None = None) -> bool:
    """True when the checkpoint verifies against its run's manifest (checkpoint_problem)."""
    return checkpoint_problem(ckpt_dir, manifest, storage_options=storage_options) is None


def require_verified(ckpt_dir: str | Path, expected_tree_sha256: str | None = None,
                     storage_options: dict | None = None) -> None:
    """Raise UnverifiedCheckpoint unless the checkpoint verifies; call before anything reads it with DCP
    (on a store, load through `verified_copy`: a check of the store's objects says nothing of a later read)."""
    if problem := checkpoint_problem(ckpt_dir, expected_tree_sha256=expected_tree_sha256,
                                     storage_options=storage_options):
        raise UnverifiedCheckpoint(f"refusing to load a checkpoint that does not verify: {problem}")


def latest_checkpoint(out_dir: str | Path, before_step: int | None = None, verify: bool = True,
                      storage_options: dict | None = None) -> Path | str | None:
    """The newest complete checkpoint (older than before_step if given) whose files match the manifest.
    UnverifiedCheckpoint when the manifest is unsigned or forged: a resume must not silently start over."""
    manifest = read_manifest(out_dir, storage_options)
    for p in reversed(list_checkpoints(out_dir, storage_options)):
        if before_step is not None and int(name_of(p).split("-")[1]) >= before_step:
            continue
        problem = checkpoint_problem(p, manifest, storage_options=storage_options) if verify else None
        if problem is None:
            return p
        print(f"[checkpoint] WARNING: skipped: {problem}", flush=True)
    return None


def load_model_for_inference(ckpt_dir: str | Path, device: str | torch.device = "cpu",
                             expected_tree_sha256: str | None = None, storage_options: dict | None = None
                             ) -> tuple[GPT, dict]:
    """Build the model from the checkpoint's JSON and load its weights (no process group needed),
    once it verifies (require_verified: its run's manifest, or `expected_tree_sha256` for a copy;
    one on an object store is downloaded and the copy verified, see `verified_copy`).

    Returns (model in eval mode, its verified meta dict).
    """
    return load_verified_model(ckpt_dir, device, expected_tree_sha256, storage_options)[:2]


def load_verified_model(ckpt_dir: str | Path, device: str | torch.device = "cpu",
                        expected_tree_sha256: str | None = None, storage_options: dict | None = None
                        ) -> tuple[GPT, dict, str]:
    """`load_model_for_inference`, also returning the tree hash of the verified copy the weights came
    from: what a record of the loaded model (an evaluation report) must name."""
    ckpt_dir = location(ckpt_dir)
    if not is_file(join(ckpt_dir, META_FILE), storage_options):
        raise FileNotFoundError(f"{ckpt_dir} is not a complete checkpoint (no {META_FILE})")
    with verified_copy(ckpt_dir, storage_options, expected_tree_sha256) as (local, tree_sha256):
        meta = read_meta(local)
        cfg = GPTConfig(**meta["model"])
        model = GPT(cfg)
        state = {"model": model.state_dict()}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _dcp_load(state, local, ckpt_dir, no_dist=True)
    model.load_state_dict(state["model"], strict=True)
    model.to(device).eval()
    return model, meta, tree_sha256


def save_model_copy(model: nn.Module, meta: dict, out_dir: str | Path) -> Path:
    """Write `model`'s weights (no optimizer state) with its signed meta file into the local directory
    `out_dir`, in the checkpoint format: what a registered model holds. `load_model_for_inference`
    reads it like a checkpoint (given its tree hash, since no manifest lists it)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model.state_dict()}, no_dist=True, **_dcp_target(out, None))
    atomic_write_text(out / META_FILE, dumps_signed({**meta, "format": FORMAT}, META_PURPOSE))
    return out
