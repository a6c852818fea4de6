"""Object-store keys and run-relative paths from outside never leave their root (issue 24).

An S3 key may hold `../` (the store keeps it as given). Used as a path unchecked, a planted object
is written outside the working copy (or a checkpoint's download folder) before anything verifies it.
Every place a key or a relative path from outside becomes a local path goes through
`tasks.core.fs.safe_join`, which refuses it."""
from __future__ import annotations

import os

import pytest

from tasks.core import storage

PLANTED = b"planted by a writer of the bucket"


def test_safe_join_refuses_what_leads_out(tmp_path):
    from tasks.core.fs import PathEscape, safe_join

    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    assert safe_join(root, "a/b.txt") == root / "a" / "b.txt"
    assert safe_join(root, "./a/./b") == root / "a" / "b" and safe_join(root, ".") == root
    for bad in ("../x", "a/../../x", "a/..", "/etc/passwd", "a/b\0c", "..", "a/../b"):
        with pytest.raises(ValueError):
            safe_join(root, bad)
    os.symlink(tmp_path, root / "out")  # a link inside the root that leads out of it
    with pytest.raises(PathEscape, match="symbolic link"):
        safe_join(root, "out/x")


def _escapes(tmp_path) -> list:
    return [p for p in tmp_path.rglob("escape*.txt")]


def test_planted_keys_with_dot_dot_are_never_written_outside_the_working_copy(tmp_path, monkeypatch):
    """RunStore.pull and a checkpoint's download (tasks.core.fs.download) over
    a bucket holding objects whose keys climb out (PathEscape, where refused loudly, is a
    ValueError). (The dedup shuffles read a store's prefix by URI: no key becomes a local path.)"""
    from s3_helpers import moto_s3
    from tasks.core import fs

    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        monkeypatch.setattr(storage, "_STORES", {})
        s3.client.put_object(Bucket="runs", Key="crucible/r1/evaluate/ok.txt", Body=b"ok")
        for n, key in enumerate(["crucible/r1/evaluate/../../../../escape0.txt",
                                 "crucible/r1/evaluate/triggered/../../../../../../escape1.txt"]):
            s3.client.put_object(Bucket="runs", Key=key, Body=PLANTED)
        assert len(s3.keys("runs", "crucible/r1/")) == 3
        store = storage.RunStore("s3://runs/crucible", s3.options, str(tmp_path / "cache" / "a" / "b" / "c"))
        assert store.pull("r1") == 1 and _escapes(tmp_path) == []
        assert (store.local_root / "r1" / "evaluate" / "ok.txt").read_bytes() == b"ok"
        with pytest.raises(ValueError):  # keys named by a job's result: refused, not skipped
            store.pull("", keys=["r1/evaluate/../../../../escape0.txt"])
        assert _escapes(tmp_path) == []
        with pytest.raises(ValueError):  # a checkpoint folder with a planted key is refused whole
            fs.download(store.uri("r1/evaluate"), tmp_path / "ckpt" / "a" / "b" / "c", s3.options)
        assert _escapes(tmp_path) == []


def test_a_token_index_cannot_name_a_cache_file_outside_the_cache(tmp_path):
    """stage_tokens names a node's cached token file after the sha256 the (store's) index records: a
    value with `/..` in it would make the cache hand back, or write, any file of the node."""
    from tasks.train.remote import _cached_file

    outside = tmp_path / "secret-train.bin"
    outside.write_bytes(b"not a token file")
    cache = tmp_path / "node" / "tokens"
    cache.mkdir(parents=True)
    with pytest.raises(ValueError):
        _cached_file(str(tmp_path / "x" / "train.bin"), "../../secret", None, cache, None)


def test_an_event_cannot_reach_another_store_working_copy_with_dot_dot(tmp_path, monkeypatch):
    """trusted_run_paths maps an event's s3:// checkpoint into the working copy of the store whose root
    it starts with; `..` in the rest of it would climb into another registered store's copy."""
    from flows.triggers import trusted_run_paths
    from infra import stack
    from infra.settings import StackConfig
    from tasks.deploy.triggered import ForgedClaim

    monkeypatch.setattr(storage, "_STORES", {})
    monkeypatch.setenv(stack.STATE_DIR_ENV, str(tmp_path / "state"))
    stack_cfg = StackConfig(state_dir=str(tmp_path / "state"))
    cache = str(tmp_path / "cache")
    for root in ("s3://runs/a", "s3://runs/b"):
        store = storage.RunStore(root, {"endpoint_url": "http://127.0.0.1:9"}, cache)
        stack.register_run_store(stack_cfg, store)
        stack.register_run_root(stack_cfg, store.local_root)
    with pytest.raises(ForgedClaim, match="refused"):
        trusted_run_paths("s3://runs/a/../b/r1/train/checkpoints/step-000010")


ALIASES = ("s3://runs/crucible/r1//train/checkpoints/step-000004", "s3://runs/crucible/r1/./train/checkpoints/step-000004",
           "s3://runs/crucible/r1/train/checkpoints/step-000004/.", "s3://runs/crucible//r1/train/checkpoints/step-000004")


def test_a_checkpoint_uri_not_in_normal_form_is_refused(tmp_path, monkeypatch):
    """S3 keeps `r1//train/...` and `r1/./train/...` as keys of their own, but as paths they collapse
    onto r1's: a claim for an attacker's prefix there (holding a replayed signed checkpoint) would be
    evaluated into, and overwrite, the real checkpoint's report slot. A key that does not round-trip
    unchanged is refused wherever a URI becomes a run's place or a record's name."""
    from s3_helpers import moto_s3

    from flows.triggers import trusted_run_paths
    from infra import stack
    from infra.settings import StackConfig
    from tasks.core import fs
    from tasks.core.layout import RunLayout
    from tasks.deploy.triggered import ForgedClaim

    monkeypatch.setattr(storage, "_STORES", {})
    monkeypatch.setenv(stack.STATE_DIR_ENV, str(tmp_path / "state"))
    stack_cfg = StackConfig(state_dir=str(tmp_path / "state"))
    real = "s3://runs/crucible/r1/train/checkpoints/step-000004"
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        stack.register_run_store(stack_cfg, store)
        stack.register_run_root(stack_cfg, store.local_root)
        fs.write_bytes(f"{real}/meta.json", b"real", s3.options)
        fs.write_bytes(f"{ALIASES[0]}/meta.json", b"attacker", s3.options)
        assert fs.read_bytes(f"{ALIASES[0]}/meta.json", s3.options) == b"attacker"  # another object
        assert RunLayout.of_checkpoint(real).triggered_eval_report(real) == \
            store.local_root / "r1" / "evaluate" / "triggered" / "step-000004.json"
        for alias in ALIASES:
            with pytest.raises(ValueError, match="normal form"):
                RunLayout.of_checkpoint(alias)
            assert not RunLayout.is_run_checkpoint(alias)
            with pytest.raises(fs.PathEscape):
                storage.local_place(alias)
            with pytest.raises(fs.PathEscape):
                fs.canonical(alias)
            with pytest.raises(ForgedClaim, match="normal form"):
                trusted_run_paths(alias)
        assert fs.canonical(real + "/") == real  # a trailing '/' names the same objects on S3
        assert trusted_run_paths(real)["checkpoint"] == real
