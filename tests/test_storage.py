"""RunStore's working copy against moto's S3 server: what pull and sync_down record decides what a
later sync downloads again."""
from __future__ import annotations

import json

from s3_helpers import moto_s3
from tasks.core import storage


def test_an_object_replaced_by_one_of_the_same_size_is_synced_after_a_pull(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "_STORES", {})
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        s3.client.put_object(Bucket="runs", Key="crucible/r1/report.json", Body=b'{"v": 1}')
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        assert store.pull("r1") == 1
        entry = json.loads((store.local_root / ".crucible-store.json").read_text())["r1/report.json"]
        assert len(entry) == 3 and entry[2], entry  # the ETag of what was pulled
        s3.client.put_object(Bucket="runs", Key="crucible/r1/report.json", Body=b'{"v": 2}')  # same size
        assert store.sync_down(["r1"]) == {"downloaded": 1, "removed": 0}
        assert (store.local_root / "r1" / "report.json").read_bytes() == b'{"v": 2}'
        assert store.sync_down(["r1"]) == {"downloaded": 0, "removed": 0}
        assert store.push()["uploaded"] == 0  # what was synced is the store's: nothing to push back
