"""A stage is a list of small steps with uniform stats (datatrove's reader → filters → writer).

A `Filter` has one method, `decide(doc) -> reason | None`: None keeps the document, a string
drops it with that reason. Filters may rewrite `doc["text"]` (C4 line removal does).
`run_filters` threads documents through a chain and accounts for every one.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator


@dataclass
class StepStats:
    """Uniform counts for one step or one whole stage. Invariant:
    docs_in == docs_out + sum(dropped.values()) + sum(quarantined.values())."""

    name: str
    docs_in: int = 0
    docs_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    dropped: Counter = field(default_factory=Counter)
    quarantined: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def balanced(self) -> bool:
        return self.docs_in == self.docs_out + sum(self.dropped.values()) + sum(self.quarantined.values())

    def merge(self, other: "StepStats") -> "StepStats":
        self.docs_in += other.docs_in
        self.docs_out += other.docs_out
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out
        self.dropped.update(other.dropped)
        self.quarantined.update(other.quarantined)
        self.seconds += other.seconds
        return self

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "docs_in": self.docs_in,
            "docs_out": self.docs_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "dropped": dict(sorted(self.dropped.items())),
            "quarantined": dict(sorted(self.quarantined.items())),
            "seconds": round(self.seconds, 3),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "StepStats":
        return cls(
            name=d["name"], docs_in=d["docs_in"], docs_out=d["docs_out"], bytes_in=d.get("bytes_in", 0),
            bytes_out=d.get("bytes_out", 0), dropped=Counter(d.get("dropped", {})),
            quarantined=Counter(d.get("quarantined", {})), seconds=d.get("seconds", 0.0),
        )


class Filter:
    """Base class: subclasses set `name` and implement `decide`."""

    name = "filter"

    def decide(self, doc: dict) -> str | None:  # pragma: no cover - interface
        raise NotImplementedError


def run_filters(docs: Iterable[dict], filters: list[Filter], stats: dict[str, StepStats],
                dropped_sink: list | None = None) -> Iterator[dict]:
    """Yield the documents every filter keeps; count each drop under `<filter>:<reason>`.

    `stats` maps filter name -> StepStats and is filled in place. When `dropped_sink` is a list,
    `(doc_id, filter, reason)` is appended for every drop, so a user can ask why a document went.
    """
    for f in filters:
        stats.setdefault(f.name, StepStats(f.name))
    for doc in docs:
        keep = True
        for f in filters:
            s = stats[f.name]
            s.docs_in += 1
            n_bytes = len(doc["text"].encode("utf-8"))
            s.bytes_in += n_bytes
            t0 = time.perf_counter()
            reason = f.decide(doc)
            s.seconds += time.perf_counter() - t0
            if reason is not None:
                s.dropped[reason] += 1
                if dropped_sink is not None:
                    dropped_sink.append((doc.get("id"), f.name, reason))
                keep = False
                break
            s.docs_out += 1
            s.bytes_out += len(doc["text"].encode("utf-8"))
        if keep:
            yield doc
