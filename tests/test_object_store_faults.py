"""An object-store run_root that cannot be used: a missing bucket or a refused key fails within
30 s, naming run_root and what to check (never the secret), with nothing written to the store or
the working copy; `crucible run` stops before the stack starts. (Apart from tests/test_object_store.py:
moto's backends and its authentication switch are per process, so its servers must not overlap.)"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from s3_helpers import moto_s3
from tasks.core.fs import StorageError
from tasks.core.storage import RunStore
from test_e2e import CRUCIBLE
from test_object_store import _client_env
from test_postgres import TINY


@pytest.mark.parametrize("fault", ["missing bucket", "wrong key"])
def test_a_store_that_refuses_fails_fast_naming_the_setting_with_nothing_written(tmp_path, fault):
    with moto_s3(tmp_path, buckets=["runs"]) as s3:
        options = dict(s3.options)
        root = "s3://runs/x"
        if fault == "missing bucket":
            root = "s3://no-such-bucket/x"
        else:
            os.environ["CRUCIBLE_TEST_WRONG_SECRET"] = "not-the-secret"
            options["secret"] = "${CRUCIBLE_TEST_WRONG_SECRET}"
        store = RunStore(root, options, str(tmp_path / "cache"))
        t0 = time.monotonic()
        with pytest.raises(StorageError) as err:
            store.check(timeout=20)
        assert time.monotonic() - t0 < 30
        msg = str(err.value)
        assert f"run_root {root}" in msg
        assert ("does not exist" in msg) if fault == "missing bucket" else ("credentials" in msg)
        assert "not-the-secret" not in msg and s3.secret not in msg
        assert s3.keys("runs") == []
        assert not (tmp_path / "cache").exists()


def test_crucible_run_on_a_missing_bucket_stops_before_the_stack_starts(tmp_path):
    with moto_s3(tmp_path, buckets=["runs"]) as s3:
        config = tmp_path / "c.yaml"
        raw = yaml.safe_load(Path(TINY).read_text())
        raw["storage"] = {"options": s3.options, "cache_dir": str(tmp_path / "cache")}
        config.write_text(yaml.safe_dump(raw))
        state = tmp_path / "state"
        t0 = time.monotonic()
        proc = subprocess.run(CRUCIBLE + ["--state-dir", str(state), "run", str(config), "--set",
                                          "run_root=s3://no-such-bucket/crucible"],
                              cwd=tmp_path, env=_client_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and time.monotonic() - t0 < 30, proc.stderr
        err = proc.stderr.strip().splitlines()[-1]
        assert err.startswith("crucible: run_root s3://no-such-bucket/crucible: the bucket 'no-such-bucket' does not exist")
        assert not any((state / "run").glob("*.pid")) and not (tmp_path / "runs").exists()
        assert not (tmp_path / "cache").exists() and s3.keys("runs") == []
        # likewise the MinHash index's bucket (checked before the stack starts, not when curate opens it)
        proc = subprocess.run(CRUCIBLE + ["--state-dir", str(state), "run", str(config), "--set",
                                          "run_root=s3://runs/crucible", "--set",
                                          "curate.dedup.minhash.index_dir=s3://no-such-bucket/index"],
                              cwd=tmp_path, env=_client_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and time.monotonic() - t0 < 60, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(
            "crucible: curate.dedup.minhash.index_dir s3://no-such-bucket/index: the bucket 'no-such-bucket' does not")
        assert not any((state / "run").glob("*.pid")) and s3.keys("runs") == []
