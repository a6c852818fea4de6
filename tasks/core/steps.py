"""A stage is a list of small steps with uniform stats (datatrove's reader → filters → writer).

A step decides, item by item, `reason | None`: None keeps the item, a string drops it with that
reason. `run_step` is the one accounting loop: every step — a heuristic `Filter` on documents
(`run_filters` chains them), a dedup decision (`tasks.dedup.steps`), a quality-model decision
(`tasks.quality.score`) — counts documents and bytes in and out, drops per reason and the time
spent deciding into one `StepStats`. A `Filter` has one method, `decide(doc)`; filters may
rewrite `doc["text"]` (C4 line removal does), so the bytes out are measured after the decision.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")


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

    def counts(self) -> dict:
        """Documents and bytes in and out, drops and quarantines per reason (a stage's totals)."""
        return {
            "docs_in": self.docs_in,
            "docs_out": self.docs_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "dropped": dict(sorted(self.dropped.items())),
            "quarantined": dict(sorted(self.quarantined.items())),
        }

    def to_dict(self) -> dict:
        return {"name": self.name, **self.counts(), "seconds": round(self.seconds, 3)}

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


def doc_bytes(doc: dict) -> int:
    """UTF-8 size of a document's text: the bytes a step counts."""
    return len(doc["text"].encode("utf-8"))


def run_step(items: Iterable[T], decide: Callable[[T], str | None], stats: StepStats,
             size: Callable[[T], int] = doc_bytes, on_drop: Callable[[T, str], None] | None = None) -> Iterator[T]:
    """Yield the items `decide` keeps, counting every item in `stats`; `on_drop(item, reason)` is
    called for each dropped one. Lazy: chained steps see one item at a time, in order."""
    for item in items:
        stats.docs_in += 1
        stats.bytes_in += size(item)
        t0 = time.perf_counter()
        reason = decide(item)
        stats.seconds += time.perf_counter() - t0
        if reason is None:
            stats.docs_out += 1
            stats.bytes_out += size(item)
            yield item
        else:
            stats.dropped[reason] += 1
            if on_drop is not None:
                on_drop(item, reason)


def decide_all(name: str, items: Iterable[T], decide: Callable[[T], str | None], size: Callable[[T], int],
               on_drop: Callable[[T, str], None] | None = None,
               started: float | None = None) -> tuple[StepStats, list[T]]:
    """`run_step` over a whole list at once (dedup, quality models): the step's stats and the kept
    items. `started`: when the step's work began (`time.perf_counter()`), so its seconds include
    computing the decisions (clustering, scoring)."""
    stats = StepStats(name)
    kept = list(run_step(items, decide, stats, size, on_drop))
    if started is not None:
        stats.seconds = time.perf_counter() - started
    return stats, kept


def run_filters(docs: Iterable[dict], filters: list[Filter], stats: dict[str, StepStats],
                dropped_sink: list | None = None) -> Iterator[dict]:
    """Yield the documents every filter keeps; count each drop under `<filter>:<reason>`.

    `stats` maps filter name -> StepStats and is filled in place. When `dropped_sink` is a list,
    `(doc_id, filter, reason)` is appended for every drop, so a user can ask why a document went.
    """
    for f in filters:
        docs = run_step(docs, f.decide, stats.setdefault(f.name, StepStats(f.name)),
                        on_drop=None if dropped_sink is None else _drop_recorder(dropped_sink, f.name))
    yield from docs


def _drop_recorder(sink: list, step: str) -> Callable[[dict, str], None]:
    """`on_drop` appending (doc id, step, reason) to `sink` (a function: each step binds its own name)."""
    return lambda doc, reason: sink.append((doc.get("id"), step, reason))
