"""What the attack tests share: a live pickle payload, and the processes below a process."""
from __future__ import annotations

from pathlib import Path


class WritesMarker:
    """Unpickling this creates the file `path`: what an attacker's planted pickle would do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def descendant_pids(roots: set[int]) -> set[int]:
    """`roots` and every process below them, from /proc (Ray's GCS, raylet and agents are the
    starter's children, its workers the raylet's)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    pids, grew = set(roots), True
    while grew:
        children = {pid for pid, ppid in parents.items() if ppid in pids} - pids
        pids |= children
        grew = bool(children)
    return pids
