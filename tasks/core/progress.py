"""Progress reporting for long stages, without tying stage logic to a UI.

Stage functions (`run_ingest`, `run_curate`) take an optional `progress(done, total, note)`
callback, called from the driver as units of work finish (ingest: source files; curate: input
row groups). Two sinks, combined with `fan_out`:

* `ConsoleProgress`: a one-line bar on stderr (rewritten in place on a terminal, one line per
  update otherwise), throttled;
* `flows/artifacts.py` (`stage_progress`) feeds a Prefect progress artifact.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

Progress = Callable[[int, int, str], None]


class Throttle:
    """True at most every `interval` seconds, and always for the last unit (done == total)."""

    def __init__(self, interval: float):
        self.interval = interval
        self._last = float("-inf")

    def __call__(self, done: int, total: int) -> bool:
        now = time.monotonic()
        if done >= total or now - self._last >= self.interval:
            self._last = now
            return True
        return False


class ConsoleProgress:
    """`label: [#####.....] 12/40 (30%) 3.1/s` on stderr."""

    def __init__(self, label: str, stream: TextIO | None = None, interval: float = 0.5, width: int = 30):
        self.label, self.width = label, width
        self.stream = stream or sys.stderr
        self.throttle = Throttle(interval)
        self.t0 = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._finished = False

    def __call__(self, done: int, total: int, note: str = "") -> None:
        if self._finished or not self.throttle(done, total):
            return
        frac = done / total if total else 1.0
        fill = int(round(frac * self.width))
        rate = done / max(time.monotonic() - self.t0, 1e-9)
        line = (f"{self.label}: [{'#' * fill}{'.' * (self.width - fill)}] {done}/{total} ({100 * frac:.0f}%) "
                f"{rate:.1f}/s{' ' + note if note and note != self.label else ''}")
        self.stream.write(("\r" + line) if self._tty else line + "\n")
        if done >= total:
            self._finished = True
            if self._tty:
                self.stream.write("\n")
        self.stream.flush()


def fan_out(*sinks: Progress | None) -> Progress:
    """One callback that calls every given sink (None entries are skipped)."""
    active = [s for s in sinks if s is not None]

    def report(done: int, total: int, note: str = "") -> None:
        for s in active:
            s(done, total, note)

    return report
