"""The trainer's private torch APIs (tasks/train/torch_private.py): every one resolves in the installed
torch (an upgrade that drops one fails here, not inside a training run), a missing one is a clear
error naming it, its use and the torch version, and tasks/train reaches them only through that module."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tasks.train.torch_private import PRIVATE_APIS, WRITTEN_FOR, private

TRAIN = Path(__file__).resolve().parent.parent / "tasks" / "train"


@pytest.mark.parametrize("name", sorted(PRIVATE_APIS))
def test_every_private_api_resolves_in_the_installed_torch(name):
    assert private(name) is not None


def test_a_missing_private_api_names_itself_its_use_and_the_torch_version(monkeypatch):
    monkeypatch.setitem(PRIVATE_APIS, "gone", ("torch.distributed.device_mesh", "DeviceMesh._gone", "a test's need"))
    with pytest.raises(RuntimeError) as e:
        private("gone")
    for part in ("DeviceMesh._gone", "a test's need", torch.__version__, WRITTEN_FOR):
        assert part in str(e.value)


def test_tasks_train_reaches_private_torch_only_through_the_guard():
    """No direct import of an underscored torch module or name, no call of the listed private methods."""
    direct = re.compile(r"from torch[\w.]*\._\w+ import|from torch[\w.]* import .*\b_[a-z]\w*|\btorch\._C\.|"
                        r"\.(_flatten|_unflatten|_get_fsdp_state)\(|\bSAC_IGNORED_OPS\b")
    found = [f"{f.name}:{i}: {line.strip()}" for f in sorted(TRAIN.glob("*.py")) if f.name != "torch_private.py"
             for i, line in enumerate(f.read_text().splitlines(), 1)
             if direct.search(line) and "private(" not in line]
    assert found == []
