"""A registered version's files, verified before anything reads them (no code runs on load; the loader
is tasks.deploy.registry.load_registered).

A version's artifacts are plain files: `checkpoint/` (the weights-only export that
tasks.train.checkpoint.load_model_for_inference reads), `tokenizer.json` and `crucible-model.json`, a
manifest of every other file's sha256 signed with the stack's key (purpose "registered-model"). There
is no MLmodel and no python_model or loader_module: MLflow's "models from code" pyfunc ran a code file
taken from the artifact store on load, and a planted MLmodel `loader_module` ran in any pyfunc
consumer before the model's own hash check. Here a copy is verified (the manifest's signature, the
set of files, each file's hash, and the manifest against the version's signed tags) before anything
in it is read; a planted file can at worst make the copy be refused.

    from tasks.deploy.registry import load_registered
    lm = load_registered("http://127.0.0.1:5000", "crucible-tiny", alias="champion")
    lm.predict(["The Linux kernel"], {"max_tokens": 16, "temperature": 0})  # -> [completion]
"""
from __future__ import annotations

import shutil
from pathlib import Path

from tasks.core.hashing import sha256_file
from tasks.core.signing import SignatureError, read_signed, write_signed

MANIFEST_NAME = "crucible-model.json"
MANIFEST_PURPOSE = "registered-model"
CHECKPOINT_DIR = "checkpoint"
TOKENIZER_NAME = "tokenizer.json"
FORMAT = "crucible-registered-model/1"


class UnverifiedModel(RuntimeError):
    """A registered version whose files cannot be verified (gone, changed, or a copy that does not match)."""


def _files(root: Path) -> dict[str, Path]:
    """Every file under root but the manifest, links too (a planted link is a file the manifest must
    list), by relative path."""
    out = {}
    for p in root.rglob("*"):
        rel = p.relative_to(root).as_posix()
        if (p.is_symlink() or p.is_file()) and rel != MANIFEST_NAME:
            out[rel] = p
    return out


def write_model_dir(model_dir: str | Path, export: str | Path, tokenizer_path: str | Path, content_hash: str,
                    source_checkpoint: str | Path) -> dict:
    """Lay out a version's files in model_dir (the export is moved in) and sign their manifest."""
    from tasks.core.hashing import sha256_tree

    root = Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    shutil.move(str(export), root / CHECKPOINT_DIR)
    shutil.copyfile(tokenizer_path, root / TOKENIZER_NAME)
    manifest = {"format": FORMAT, "content_hash": content_hash, "source_checkpoint": str(source_checkpoint),
                "export_sha256": sha256_tree(root / CHECKPOINT_DIR),
                "tokenizer_sha256": sha256_file(root / TOKENIZER_NAME),
                "files": {rel: sha256_file(p) for rel, p in sorted(_files(root).items())}}
    write_signed(root / MANIFEST_NAME, manifest, MANIFEST_PURPOSE)
    return manifest


def verify_model_dir(root: str | Path, tags: dict, what: str) -> tuple[Path, Path, str]:
    """(checkpoint, tokenizer, export tree hash) of a downloaded copy, once it verifies: its manifest
    is signed, it holds exactly the files the manifest lists with their hashes, and the manifest names
    the content, export and tokenizer hashes of the version's verified tags. UnverifiedModel otherwise;
    nothing in the copy is parsed before (the manifest is JSON)."""
    root = Path(root)
    try:
        manifest = read_signed(root / MANIFEST_NAME, MANIFEST_PURPOSE)
    except (OSError, SignatureError) as e:
        raise UnverifiedModel(f"{what}: no signed manifest that verifies ({e})") from None
    for key in ("export_sha256", "tokenizer_sha256"):
        if not tags.get(key):
            raise UnverifiedModel(f"{what}: the version has no signed {key} to verify it against")
        if manifest.get(key) != tags[key]:
            raise UnverifiedModel(f"{what}: its manifest's {key} is not the one in the version's signed tags")
    if tags.get("content_hash") and manifest.get("content_hash") != tags["content_hash"]:
        raise UnverifiedModel(f"{what}: its manifest's content_hash is not the one in the version's signed tags")
    listed, on_disk = manifest.get("files") or {}, _files(root)
    if extra := sorted(set(on_disk) - set(listed)):
        raise UnverifiedModel(f"{what} holds files its signed manifest does not list: {extra[:3]}")
    for rel, digest in listed.items():
        if rel not in on_disk or on_disk[rel].is_symlink() or sha256_file(on_disk[rel]) != digest:
            raise UnverifiedModel(f"{what}: {rel} is missing or not the file its signed manifest records")
    return root / CHECKPOINT_DIR, root / TOKENIZER_NAME, manifest["export_sha256"]


def download_verified(tracking_uri: str, version: dict, dst: str | Path, what: str) -> tuple[Path, Path, str]:
    """Download a version's registered copy into dst (a folder of its own) and verify it."""
    import mlflow.artifacts

    local = mlflow.artifacts.download_artifacts(artifact_uri=version["source"], dst_path=str(dst),
                                                tracking_uri=tracking_uri)
    return verify_model_dir(local, version["tags"], what)
