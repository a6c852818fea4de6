"""The stack's signing key and signed records (tasks/core/signing.py)."""
from __future__ import annotations

import os

import pytest

from tasks.core import signing
from tasks.core.signing import SIGNING_KEY_FILE_ENV, SignatureError


@pytest.fixture
def key(tmp_path, monkeypatch):
    path = tmp_path / "secrets" / "signing.key"
    monkeypatch.setenv(SIGNING_KEY_FILE_ENV, str(path))
    monkeypatch.setattr(signing, "_cache", {})
    return path


def test_a_record_verifies_for_its_purpose_only_and_not_once_altered(key):
    record = signing.sign_record({"step": 10, "val_loss": 2.5}, "eval-report")
    assert signing.verify_record(record, "eval-report") == {"step": 10, "val_loss": 2.5}
    assert oct(key.stat().st_mode & 0o777) == "0o600" and oct(key.parent.stat().st_mode & 0o777) == "0o700"
    with pytest.raises(SignatureError, match="does not verify"):
        signing.verify_record(record, "gate-record")  # a signed report never passes as another kind
    with pytest.raises(SignatureError, match="does not verify"):
        signing.verify_record({**record, "val_loss": 0.1}, "eval-report")
    with pytest.raises(SignatureError, match="unsigned"):
        signing.verify_record({"step": 10, "val_loss": 2.5}, "eval-report")
    # a tag's signature binds its name: moved to another tag it does not verify
    sig = signing.sign_value("content_hash", "abc", "registry-tag m v1")
    assert signing.verify_value("content_hash", "abc", sig, "registry-tag m v1") == "abc"
    with pytest.raises(SignatureError):
        signing.verify_value("export_sha256", "abc", sig, "registry-tag m v1")


def test_a_key_others_could_write_or_read_signs_nothing(key):
    signing.ensure_key_file(key)
    os.chmod(key, 0o644)  # world-readable: anyone on the host could sign
    with pytest.raises(SignatureError, match="not private"):
        signing.sign_bytes(b"x", "p")
    os.chmod(key, 0o620)  # group-writable: anyone in the group could plant their own key
    with pytest.raises(SignatureError, match="not private"):
        signing.sign_bytes(b"x", "p")
    os.chmod(key, 0o440)  # a Secret mounted for the pod's fsGroup: group-readable only
    assert signing.sign_bytes(b"x", "p").startswith("hmac-sha256:")
