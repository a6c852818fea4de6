"""Replay a JSONL OpenLineage log (one event per line) to a lineage endpoint, in batches.

Works against Crucible's lineage service (infra/services/lineage, which takes a JSON array per
POST) and against Marquez (which takes one event per POST): the first batch is sent as an array,
and if the server refuses arrays the replay falls back to one event per request on the same
keep-alive connection.

    python -m tasks.lineage.replay runs/<run>/lineage.jsonl http://127.0.0.1:5055

The service's write token is sent as a bearer token: $CRUCIBLE_LINEAGE_TOKEN, or the file
$CRUCIBLE_LINEAGE_TOKEN_FILE names (`crucible lineage replay` uses the stack's). Only lines that
carry the stack's signature are sent (tasks/lineage/signed.py): an unsigned, forged or altered line,
e.g. one a writer of the run directory appended, is refused, logged and counted ("refused"), never
sent with the token.
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import httpx

from tasks.lineage.signed import signed_lines

LINEAGE_PATH = "/api/v1/lineage"


class ReplayError(RuntimeError):
    """The endpoint refused an event (the message has the HTTP status and the server's answer)."""


def lineage_url(url: str) -> str:
    """A base URL (http://host:port) gets Marquez's lineage path; a full endpoint URL is kept."""
    path = urlsplit(url).path
    return url.rstrip("/") + LINEAGE_PATH if path in ("", "/") else url


def iter_events(jsonl_path: str | Path, refused: list | None = None) -> Iterator[dict]:
    """The log's signed events (each other line is logged as refused, its number added to `refused`)."""
    for _, event in signed_lines(jsonl_path, refused):
        yield event


def _lines(jsonl_path: str | Path, refused: list) -> Iterator[bytes]:
    """The log's signed lines as they are (verified, then sent as written)."""
    for line, _ in signed_lines(jsonl_path, refused):
        yield line


def _prefetched(items: Iterator, depth: int = 2) -> Iterator:
    """`items` in order, produced by a thread up to `depth` ahead: the next batch is read and its
    signatures checked while the server stores the previous one (replaying a log alternated the
    two, about 40% of the time of a 10,000-event replay spent on this side). An exception of
    `items` is raised here, at its place; leaving the loop early stops the thread."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((done, None))
        except BaseException as e:  # handed to the consumer, raised there
            put((done, e))

    thread = threading.Thread(target=produce, name="replay-reader", daemon=True)
    thread.start()
    try:
        while True:
            item, error = q.get()
            if item is done:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
        thread.join()


def _batches(lines: Iterator[bytes], size: int) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for line in lines:
        batch.append(line)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def replay(jsonl_path: str | Path, url: str, *, batch_size: int = 500, timeout: float = 60.0,
           client: httpx.Client | None = None, single: bool = False, token: str | None = None,
           in_flight: int | None = None) -> dict:
    """POST every signed event of `jsonl_path` to `url`; returns counts (ingested/duplicates when the
    server reports them; refused: lines without a valid signature, never sent). Signed lines are
    sent as they are (the server checks them); a refused batch raises ReplayError with the server's answer. `client`: an httpx.Client to use (e.g. FastAPI's
    TestClient). `token`: the service's write token (default: lineage_token(), from the environment).
    `in_flight`: batches posted at once after the first (default 2 with replay's own client, 1 with
    a given one): the service parses and validates the next batch while SQLite writes the previous
    one (the store orders each run's events by time, whatever order they arrive in)."""
    from tasks.lineage.transport import lineage_token

    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    endpoint = lineage_url(url)
    own = client is None
    client = client or httpx.Client(timeout=timeout)
    summary = {"url": endpoint, "events": 0, "requests": 0, "ingested": 0, "duplicates": 0, "refused": 0,
               "mode": "single" if single else "batch"}
    refused: list[int] = []
    token = token or lineage_token()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}

    def post(body: bytes) -> httpx.Response:
        summary["requests"] += 1
        return client.post(endpoint, content=body, headers=headers)

    def count(resp: httpx.Response, n: int) -> None:
        summary["events"] += n
        try:
            body = resp.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and "ingested" in body:
            summary["ingested"] += body.get("ingested", 0)
            summary["duplicates"] += body.get("duplicates", 0)
        else:  # Marquez answers with no count
            summary["ingested"] += n

    def send_single(batch: list[bytes]) -> None:
        for line in batch:
            resp = post(line)
            if resp.status_code >= 300:
                raise ReplayError(f"{endpoint} answered {resp.status_code}: {resp.text[:500]}")
            count(resp, 1)

    def settle(resp: httpx.Response, n: int) -> None:
        if resp.status_code >= 300:
            raise ReplayError(f"{endpoint} answered {resp.status_code}: {resp.text[:500]}")
        count(resp, n)

    in_flight = max(1, in_flight if in_flight is not None else (2 if own else 1))
    batches = _prefetched(_batches(_lines(jsonl_path, refused), batch_size))
    pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="replay-post") if in_flight > 1 else None
    pending: deque = deque()  # (future answer, events), oldest first: answers are settled in order
    try:
        for batch in batches:
            if summary["mode"] == "single":
                send_single(batch)
                continue
            body = b"[" + b",".join(batch) + b"]"
            if summary["requests"] == 0:  # the first batch alone: it tells whether arrays are taken
                resp = post(body)
                if resp.status_code in (400, 404, 405, 415, 422):
                    # maybe a server that takes one event per request (Marquez): try that
                    summary["mode"] = "single"
                    send_single(batch)
                else:
                    settle(resp, len(batch))
                continue
            if pool is None:
                settle(post(body), len(batch))
                continue
            summary["requests"] += 1
            pending.append((pool.submit(client.post, endpoint, content=body, headers=headers), len(batch)))
            if len(pending) >= in_flight:
                future, n = pending.popleft()
                settle(future.result(), n)
        while pending:
            future, n = pending.popleft()
            settle(future.result(), n)
    finally:
        if pool is not None:
            for future, _ in pending:
                future.cancel()
            pool.shutdown(wait=True)
        batches.close()  # the reader thread stopped (and done with `refused`) before it is counted
        summary["refused"] = len(refused)
        if own:
            client.close()
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.lineage.replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jsonl", nargs="+", help="lineage.jsonl file(s)")
    parser.add_argument("url", help="lineage service or Marquez base URL, or the full /api/v1/lineage URL")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--single", action="store_true", help="one event per request")
    args = parser.parse_args(argv)
    for path in args.jsonl:
        try:
            print(json.dumps({"file": path, **replay(path, args.url, batch_size=args.batch_size,
                                                    single=args.single)}))
        except (ReplayError, ValueError, OSError, httpx.HTTPError) as e:
            print(f"replay of {path} failed: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
