"""How lineage events leave the process: the JSONL log first (the record), then HTTP, best effort.

`make_transport` returns a CompositeTransport of [LogFileTransport] or, when an HTTP endpoint is
configured (the stack's lineage service, or Marquez via `lineage.http_url`), [LogFileTransport,
BestEffortHttpTransport]. The composite signs each event first (its `crucible_signature` facet,
tasks/lineage/signed.py), so the line written and the event sent are the same signed event; the
file is appended to without following a symbolic link. The composite stops at the first failure
(`continue_on_failure=False`), and only the file can fail: an error writing the JSONL fails the
run, because that file is the ground truth. The HTTP transport never raises: a refused connection,
a timeout or an error status is logged once per outage, counted, and the endpoint is skipped for
`COOLDOWN_S` seconds, so a lineage service that is down costs the pipeline nothing. Events missed
that way are in the JSONL log; `crucible lineage replay` sends them later (the service ingests
idempotently), and the pretrain flow does so itself at the end when the service is back.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from urllib.parse import urlsplit

from openlineage.client.serde import Serde
from openlineage.client.transport.composite import CompositeConfig, CompositeTransport
from openlineage.client.transport.http import HttpConfig, HttpTransport
from openlineage.client.transport.transport import Transport

from tasks.lineage.signed import append_line, sign_run_event

log = logging.getLogger("crucible.lineage")

LINEAGE_ENDPOINT = "api/v1/lineage"  # Marquez's and the lineage service's
COOLDOWN_S = 30.0
# A refused connection fails at once (connect=0); a 5xx answer is retried twice with back-off.
HTTP_RETRY = {"total": 2, "connect": 0, "read": 1, "status": 2, "backoff_factor": 0.2,
              "status_forcelist": [500, 502, 503, 504], "allowed_methods": ["POST"]}


@dataclass
class HttpStats:
    """Per endpoint, per process: events sent, failed and skipped (endpoint in cool-down)."""

    url: str
    sent: int = 0
    failed: int = 0
    skipped: int = 0
    last_error: str | None = None
    down_until: float = 0.0

    @property
    def missed(self) -> int:
        return self.failed + self.skipped

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("down_until")
        return d


_LOCK = threading.Lock()
_STATS: dict[str, HttpStats] = {}


def http_stats(url: str) -> HttpStats:
    with _LOCK:
        return _STATS.setdefault(url, HttpStats(url))


def reset_http_stats() -> None:
    with _LOCK:
        _STATS.clear()


def split_lineage_url(url: str) -> tuple[str, str]:
    """(base URL, endpoint) for openlineage's HttpConfig: a base such as http://host:5000 gets
    `api/v1/lineage`; a full endpoint URL (any path) is kept as given."""
    parts = urlsplit(url.strip())
    if not (parts.scheme in ("http", "https") and parts.netloc):
        raise ValueError(f"not an http(s) URL: {url!r}")
    base = f"{parts.scheme}://{parts.netloc}/"
    path = parts.path.strip("/")
    return base, (path if path else LINEAGE_ENDPOINT)


def endpoint_url(url: str) -> str:
    """The full URL events are POSTed to (the key of `http_stats`)."""
    base, endpoint = split_lineage_url(url)
    return base.rstrip("/") + "/" + endpoint.lstrip("/")


class BestEffortHttpTransport(HttpTransport):
    """openlineage's HttpTransport that logs instead of raising, with a cool-down per endpoint."""

    kind = "crucible_best_effort_http"
    config_class = HttpConfig

    def __init__(self, config: HttpConfig) -> None:
        super().__init__(config)
        self.target = self.url.rstrip("/") + "/" + self.endpoint.lstrip("/")  # == endpoint_url(...)

    def emit(self, event):  # noqa: ANN001 - openlineage's Event union
        stats = http_stats(self.target)
        now = time.monotonic()
        with _LOCK:
            if now < stats.down_until:
                stats.skipped += 1
                return None
        try:
            resp = super().emit(event)
        except Exception as e:  # noqa: BLE001 - never fail the pipeline over an unreachable service
            with _LOCK:
                first = stats.last_error is None  # warn once per outage
                stats.failed += 1
                stats.last_error = f"{type(e).__name__}: {str(e)[:300]}"
                stats.down_until = time.monotonic() + COOLDOWN_S
            if first:
                log.warning("lineage endpoint %s unavailable (%s); events stay in the JSONL log, retrying in "
                            "%.0fs; send them later with `crucible lineage replay`", self.target,
                            stats.last_error, COOLDOWN_S)
            return None
        with _LOCK:
            if stats.last_error is not None:
                log.info("lineage endpoint %s is reachable again", self.target)
            stats.sent += 1
            stats.last_error = None
            stats.down_until = 0.0
        return resp


class LogFileTransport(Transport):
    """Appends each event as one JSON line to the run's lineage log, never through a symbolic link
    (openlineage's FileTransport opens the path as given: a link planted in its place would make
    the pipeline append to any file it may write)."""

    kind = "crucible_log_file"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def emit(self, event):  # noqa: ANN001 - openlineage's Event union
        append_line(self.path, Serde.to_json(event) + "\n")


class RecordFirstTransport(CompositeTransport):
    """CompositeTransport over ready-made transports: the JSONL file first, then HTTP; each event is
    signed before any of them sees it."""

    def __init__(self, children: list[Transport]) -> None:
        self._children = list(children)
        super().__init__(CompositeConfig(transports=[{"type": t.kind} for t in self._children],
                                         continue_on_failure=False, continue_on_success=True))

    @cached_property
    def transports(self) -> list[Transport]:
        return self._children

    def emit(self, event):  # noqa: ANN001 - openlineage's Event union
        sign_run_event(event)
        return super().emit(event)


def lineage_token() -> str | None:
    """The lineage service's write token for this process: $CRUCIBLE_LINEAGE_TOKEN, else the file
    $CRUCIBLE_LINEAGE_TOKEN_FILE names (what the stack hands its processes); None: send none."""
    import os

    from tasks.core.constants import LINEAGE_TOKEN_ENV, LINEAGE_TOKEN_FILE_ENV

    if os.environ.get(LINEAGE_TOKEN_ENV, "").strip():
        return os.environ[LINEAGE_TOKEN_ENV].strip()
    path = os.environ.get(LINEAGE_TOKEN_FILE_ENV)
    if path:
        try:
            return Path(path).read_text().strip() or None
        except OSError as e:
            log.warning("cannot read the lineage token file %s: %s", path, e)
    return None


def make_transport(log_path: str | Path, http_url: str | None = None, timeout: float = 5.0) -> Transport:
    """The JSONL file (append) alone, or file + best-effort HTTP to `http_url` (with the write token,
    lineage_token(), as a bearer token when there is one); events signed first."""
    file_transport = LogFileTransport(log_path)
    if not http_url:
        return RecordFirstTransport([file_transport])
    base, endpoint = split_lineage_url(http_url)
    settings = {"url": base, "endpoint": endpoint, "timeout": timeout, "retry": HTTP_RETRY}
    if token := lineage_token():
        settings["auth"] = {"type": "api_key", "apiKey": token}
    config = HttpConfig.from_dict(settings)
    if urlsplit(base).hostname in ("127.0.0.1", "localhost", "::1"):
        import requests

        config.session = requests.Session()
        config.session.trust_env = False  # loopback: never through a proxy from the environment
    http = BestEffortHttpTransport(config)
    return RecordFirstTransport([file_transport, http])


def service_healthy(base_url: str, timeout: float = 1.0) -> bool:
    """GET <base>/healthz answers 2xx (the lineage service; loopback, so no proxy)."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(base_url.rstrip("/") + "/healthz", timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False
