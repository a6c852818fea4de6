"""An OpenAI-compatible completion server for a Crucible checkpoint.

    python -m infra.services.model_server --checkpoint DIR --tokenizer tokenizer.json --model-name NAME \\
        [--host 127.0.0.1] [--port 8600]

Endpoints:
    POST /v1/completions   prompt (string, list of strings, token ids), max_tokens, temperature,
                           top_p, stop, n, seed, echo, logprobs (0..5), stream (server-sent events
                           in OpenAI's chunk format, ending with `data: [DONE]`; stream_options
                           include_usage; with logprobs, a choice's logprobs come in its
                           final chunk, the one with finish_reason); top_k as an extension.
    POST /v1/chat/completions  messages (system/developer/user/assistant, text), the same sampling
                           fields, stream: a base model has no chat template, so the messages
                           become a plain role-prefixed transcript ("User: ...\nAssistant:") and
                           generation stops before the next "User:" or "System:" turn
    GET  /v1/models        the one served model;  GET /v1/models/{id}
    POST /v1/admin/reload  {"version": N} or {"alias": "champion"}: serve another registered version
                           of the model, resolved through the MLflow registry and verified (never a
                           path); requests already admitted finish on the old one. Needs the admin
                           token (--admin-key-file), which is never the clients' key.
    GET  /health           {"status": "ok", model, version, step, batching stats, ...}: no paths;
                           ?challenge=NONCE adds "identity": HMAC(admin key, purpose | port | NONCE), the
                           proof the supervisor asks for before it trusts the answer (identity.py)

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: malformed or
unsupported requests get 400, a body over the size limit 413, too many concurrent streams or
non-streamed requests 429 (at once), a non-streamed request unfinished after the request timeout 503
(its choices are cancelled, as are an abandoned request's), an unknown model 404, a missing/wrong bearer token 401 (when the server has an API key: --api-key-file
PATH holds it, or --api-key-env NAME names the environment variable holding it; a named source that is
empty or unset stops the server from starting); nothing a client sends stops the server.

Nothing a client does starves /health or the admin API: a non-streamed request waits for its
completion without holding a thread (it is admitted up to --max-requests at once), /health and the
auth checks run on the event loop, and a reload runs on a thread of its own.

Generation is continuously batched (scheduler.py): one thread steps all active
sequences together with a KV cache and admits new requests between steps.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Union

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from infra.services.model_server import identity
from infra.services.model_server.scheduler import BatchScheduler
from tasks.deploy.generation import Sequence, TextGenerator, choice_seed

log = logging.getLogger("crucible.server")

MAX_PROMPTS = 64  # prompts per request
MAX_CHOICES = 64  # prompts x n per request
MAX_PROMPT_CHARS = 200_000
MAX_STOP = 4
MAX_LOGPROBS = 5  # as OpenAI's completions API


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, which every 4xx of this server has."""
    error: ErrorDetail


# documented on every route (the OpenAPI schema clients and fuzzers read)
ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in (
    (400, "malformed or unsupported request, or over a limit the message names"),
    (401, "missing or wrong bearer token"), (403, "the admin API is disabled"), (404, "unknown model or path"),
    (413, "request body over the size limit"), (429, "too many concurrent streams or requests"),
    (503, "the completion did not finish within the server's request timeout"))}


# a completion answers JSON, or server-sent events with stream=true
STREAMED = {200: {"content": {"application/json": {}, "text/event-stream": {}},
                  "description": "the completion; with stream=true, server-sent events ending with `data: [DONE]`"}}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


PromptT = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(BaseModel):
    """OpenAI's /v1/completions body. Fields sent as null take their defaults; unknown fields are
    ignored, as clients add vendor fields freely."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: PromptT | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, gt=0)  # extension (vLLM also accepts it)
    n: StrictInt | None = Field(default=None, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    echo: bool | None = None
    stream: bool | None = None
    logprobs: StrictInt | None = Field(default=None, ge=0)
    stream_options: dict[str, Any] | None = None
    best_of: StrictInt | None = None
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class ReloadRequest(BaseModel):
    """A registered version of the served model, by number or alias; never a filesystem path."""
    model_config = ConfigDict(extra="forbid")

    version: StrictInt | None = Field(default=None, ge=1)
    alias: StrictStr | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$")


# (version or None, alias or None) -> (checkpoint, tokenizer, tree hash of a copy or None, version):
# the registered files, verified (infra/services/model_server/__main__.py resolves them in MLflow)
ResolveVersion = Any


def _loc_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # pydantic appends the union member tried (e.g. "str", "list[int]") to the location; drop those
    keep = [p for p in parts if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool")]
    return ".".join(keep) if keep else None


class ServerState:
    """The generator being served (swapped by /v1/admin/reload) and the batching scheduler."""

    def __init__(self, generator: TextGenerator, max_batch: int, version: int | None, max_streams: int,
                 max_requests: int, request_timeout: float):
        self.generator = generator
        self.version = version
        self.scheduler = BatchScheduler(max_batch)
        self.reload_lock = threading.Lock()
        self.reloads = 0
        self.max_streams = max_streams
        self.streams = threading.BoundedSemaphore(max_streams)
        # non-streamed completions being answered: admission limit (429 above) and deadline (503 after)
        self.max_requests, self.request_timeout = max_requests, request_timeout
        self.requests = threading.BoundedSemaphore(max_requests)
        # reloads run here, never on the request threads a crowd of clients can exhaust
        self.admin_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="crucible-admin")


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 before anything parses it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge(self.limit)
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send):
        body = json.dumps(error_body(f"the request body is larger than this server's limit of {self.limit} bytes",
                                     param=None, code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(StarletteHTTPException):
    """Raised while the body is read: FastAPI passes HTTP exceptions through, so it stays a 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than this server's limit of {limit} bytes")


class SlotStream(StreamingResponse):
    """A streamed completion holding one of the server's stream slots: released, and the request's
    sequences cancelled, however the response ends (done, failed, or the client gone before the
    first byte, when the body generator never runs)."""

    def __init__(self, job: "CompletionJob", slots: threading.BoundedSemaphore):
        super().__init__(job.stream(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job, self.slots = job, slots

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()
            self.slots.release()


def create_app(generator: TextGenerator, model_name: str, max_tokens_limit: int = 1024, max_n: int = 16,
               api_key: str | None = None, max_batch: int = 32, admin_key: str | None = None,
               resolve_version: ResolveVersion | None = None, version: int | None = None,
               max_body_bytes: int = 1 << 20, max_streams: int = 64, max_requests: int = 32,
               request_timeout: float = 300.0) -> FastAPI:
    """The app serving `generator` as `model_name` (registered `version`, when known). api_key: the
    clients' bearer token (None: open); admin_key: the admin API's, which must differ (None: the
    admin API answers 403, and /health proves no identity); resolve_version: how /v1/admin/reload
    finds a registered version; max_requests / request_timeout: concurrent non-streamed completions
    (429 above) and the seconds one may take (503 after)."""
    if admin_key and api_key and hmac.compare_digest(admin_key.encode(), api_key.encode()):
        raise ValueError("the admin key must not be the clients' API key")
    state = ServerState(generator, max_batch, version, max_streams, max_requests, request_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if state.scheduler.stopped:  # the app started again after a shutdown (an in-process client's)
            state.scheduler = BatchScheduler(max_batch)
        yield
        state.scheduler.shutdown()

    app = FastAPI(title="Crucible model server", version="1", docs_url="/docs", redoc_url=None, lifespan=lifespan)
    app.state.crucible = state
    _add_error_handlers(app)
    auth = [Depends(_key_check(api_key))]
    app.include_router(_models_router(state, model_name, auth, api_key, admin_key))
    app.include_router(_admin_router(state, [Depends(_key_check(admin_key, admin=True))], resolve_version))
    app.include_router(_completions_router(state, model_name, auth, max_tokens_limit, max_n))
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    return app


def _key_check(api_key: str | None, admin: bool = False):
    """A dependency refusing requests without the server's bearer token (none: all pass; for the
    admin API, none: it is disabled). Async: it runs on the event loop, never waiting for a thread."""
    async def require_key(request: Request) -> None:
        if not api_key:
            if admin:
                raise APIError(403, "the admin API is disabled: the server was started without an admin key",
                               None, "admin_disabled")
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            msg = ("You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'." if not auth
                   else "Incorrect API key provided.")
            raise APIError(401, msg, None, "invalid_api_key")
    return require_key


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape; nothing a client sends surfaces as a framework error."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            msg = "We could not parse the JSON body of your request. The body must be valid JSON."
            return JSONResponse(error_body(msg), status_code=400)
        if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
            return JSONResponse(error_body("The request body must be a JSON object."), status_code=400)
        param = _loc_param(tuple(first.get("loc", ())))
        msg = f"Invalid value for '{param}': {first.get('msg')}" if param else str(first.get("msg"))
        return JSONResponse(error_body(msg, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code)
        return JSONResponse(error_body(str(e.detail), param=None, code=code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))  # 405 keeps its Allow header

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(f"internal server error: {type(e).__name__}", "server_error"),
                            status_code=500)


def _models_router(state: ServerState, model_name: str, auth: list, api_key: str | None,
                   admin_key: str | None) -> APIRouter:
    """GET /health and the model listing."""
    router = APIRouter(responses=ERRORS)
    created = int(state.generator.loaded_at)
    started = time.time()

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "crucible",
                "root": model_name, "version": state.version, "max_model_len": state.generator.seq_len}

    @router.get("/health")
    async def health(request: Request, challenge: str | None = Query(default=None, pattern=identity.NONCE_PATTERN)
                     ) -> dict:
        """No paths: anyone who can reach the port can read it. On the event loop, so no crowd of
        requests holding threads delays it. With a challenge, the proof that this process holds the
        admin key, bound to the port it was reached on (identity.py)."""
        g = state.generator
        out = {"status": "ok", "model": model_name, "version": state.version,
               "step": g.meta.get("step"), "seq_len": g.seq_len, "vocab_size": g.vocab_size,
               "uptime_s": round(time.time() - started, 1), "reloads": state.reloads,
               "batching": state.scheduler.stats(), "auth": bool(api_key)}
        if challenge is not None:
            port = (request.scope.get("server") or (None, 0))[1] or 0
            out["identity"] = identity.proof(admin_key, port, challenge) if admin_key else None
        return out

    @router.get("/v1/models", dependencies=auth)
    def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model_id:path}", dependencies=auth)
    def get_model(model_id: str) -> dict:
        if model_id != model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", "model", "model_not_found")
        return model_card()

    return router


def _admin_router(state: ServerState, auth: list, resolve_version: ResolveVersion | None) -> APIRouter:
    """POST /v1/admin/reload: swap in another registered version without dropping requests."""
    router = APIRouter(responses=ERRORS)

    @router.post("/v1/admin/reload", dependencies=auth)
    async def reload(req: ReloadRequest) -> dict:
        """Resolve the version in the registry, verify its files, load it and make it the served
        model (on the admin thread). Sequences already admitted keep the generator they were encoded
        with and finish on it."""
        return await asyncio.get_running_loop().run_in_executor(state.admin_pool, swap, req)

    def swap(req: ReloadRequest) -> dict:
        if (req.version is None) == (req.alias is None):
            raise APIError(400, "send exactly one of 'version' (a number) and 'alias' (e.g. \"champion\")",
                           "version", "invalid_value")
        if resolve_version is None:
            raise APIError(400, "this server has no model registry to resolve versions in (--tracking-uri)",
                           None, "no_registry")
        what = f"version {req.version}" if req.version is not None else f"alias {req.alias!r}"
        with state.reload_lock:
            old_version = state.version
            try:
                checkpoint, tokenizer, copy_hash, version = resolve_version(req.version, req.alias)
                new = TextGenerator.from_files(checkpoint, tokenizer, expected_tree_sha256=copy_hash)
            except (OSError, ValueError, KeyError, RuntimeError, LookupError) as e:
                raise APIError(400, f"cannot serve {what}: {type(e).__name__}: {e}", "version",
                               "invalid_value") from None
            state.generator, state.version = new, version
            state.reloads += 1
        log.info("reloaded: now serving version %s (step %s), was version %s", version, new.meta.get("step"),
                 old_version)
        return {"status": "reloaded", "version": version, "step": new.meta.get("step"), "previous": old_version}

    return router


def _completions_router(state: ServerState, model_name: str, auth: list, max_tokens_limit: int,
                        max_n: int) -> APIRouter:
    """POST /v1/completions: validate, submit the choices to the scheduler, answer or stream."""
    router = APIRouter(responses=ERRORS)

    @router.post("/v1/completions", dependencies=auth, responses=STREAMED)
    async def completions(req: CompletionRequest, request: Request):
        gen = state.generator  # one generator for the whole request, even if a reload happens meanwhile
        return await answer(lambda: CompletionJob(model_name, _sampling_settings(req, gen, model_name,
                                                                                 max_tokens_limit, max_n)),
                            gen, bool(req.stream), request)

    async def answer(make_job, gen: TextGenerator, streamed: bool, request: Request):
        """One answer (admitted up to max_requests at once, awaited on the event loop without a
        thread, within the request timeout), or server-sent events within the concurrent-streams
        limit. The settings are validated and the prompts encoded on a worker thread."""
        if not streamed:
            if not state.requests.acquire(blocking=False):
                raise APIError(429, f"this server answers at most {state.max_requests} non-streamed completions "
                               "at once; retry later", None, "too_many_requests")
            try:
                job = await run_in_threadpool(make_job)
                await run_in_threadpool(job.submit, gen, state.scheduler)
                return await job.finish(state.request_timeout, request.is_disconnected)
            finally:
                state.requests.release()
        job = await run_in_threadpool(make_job)
        if not state.streams.acquire(blocking=False):
            raise APIError(429, f"this server allows at most {state.max_streams} concurrent streams; retry later",
                           "stream", "too_many_streams")
        try:
            job.submit(gen, state.scheduler)
        except BaseException:
            state.streams.release()
            raise
        return SlotStream(job, state.streams)

    @router.post("/v1/chat/completions", dependencies=auth, responses=STREAMED)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        gen = state.generator
        return await answer(lambda: ChatJob(model_name, _chat_settings(req, gen, model_name, max_tokens_limit, max_n)),
                            gen, bool(req.stream), request)

    return router


@dataclass
class SamplingSettings:
    """A completion request, validated against the server's limits, with OpenAI's defaults filled in."""
    req: CompletionRequest
    prompts: list[tuple[str, list[int]]]  # (prompt text, prompt ids)
    echo: bool
    max_tokens: int
    n: int
    stop: list[str]
    temperature: float
    top_p: float
    include_usage: bool


def _sampling_settings(req: CompletionRequest, gen: TextGenerator, model_name: str, max_tokens_limit: int,
                       max_n: int) -> SamplingSettings:
    """The request's settings; raises APIError (400/404) for what this server refuses."""
    prompts, echo = _prompts(req, gen), bool(req.echo)
    _check_unsupported(req)
    if req.model is not None and req.model != model_name:
        raise APIError(404, f"The model '{req.model}' does not exist; this server serves '{model_name}'",
                       "model", "model_not_found")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens > max_tokens_limit:
        raise APIError(400, f"max_tokens is {max_tokens}; this server allows at most {max_tokens_limit}",
                       "max_tokens", "invalid_value")
    n = 1 if req.n is None else req.n
    if n > max_n:
        raise APIError(400, f"n is {n}; this server allows at most {max_n}", "n", "invalid_value")
    if n * len(prompts) > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts x n={n} exceeds {MAX_CHOICES} completions per request",
                       "n", "invalid_value")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise APIError(400, f"at most {MAX_STOP} stop sequences are allowed", "stop", "invalid_value")
    if req.logprobs is not None and req.logprobs > MAX_LOGPROBS:
        raise APIError(400, f"logprobs is {req.logprobs}; at most {MAX_LOGPROBS} are allowed", "logprobs",
                       "invalid_value")
    include_usage = bool((req.stream_options or {}).get("include_usage"))
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "stream_options", "invalid_value")
    return SamplingSettings(req, prompts, echo, max_tokens, n, stop,
                            1.0 if req.temperature is None else req.temperature,
                            1.0 if req.top_p is None else req.top_p, include_usage)


class CompletionJob:
    """One request's choices in the scheduler: the scheduler thread reports their progress through
    a queue, which the request's thread turns into one answer or into server-sent events."""

    id_prefix, object_name, chunk_object = "cmpl-", "text_completion", "text_completion"

    def __init__(self, model_name: str, settings: SamplingSettings):
        self.model_name, self.settings = model_name, settings
        self.events: queue.Queue = queue.Queue()
        self.seqs: list[Sequence] = []
        self.prompt_tokens = 0
        self.cid, self.created = f"{self.id_prefix}{uuid.uuid4().hex}", 0  # created: when the choices are submitted
        self._lock = threading.Lock()
        self._finished = 0
        self._waker = None  # finish(): wakes the awaiting request when the last choice is done

    def _on_event(self, seq: Sequence, delta: str, finished: bool) -> None:
        self.events.put((seq.index, delta, finished))
        if finished:
            with self._lock:
                self._finished += 1
                waker = self._waker if self._finished == len(self.seqs) else None
            if waker is not None:
                waker()

    def submit(self, gen: TextGenerator, scheduler: BatchScheduler) -> None:
        """n sequences per prompt; choice j of a seeded prompt i draws from choice_seed(seed + i, j)."""
        st, req = self.settings, self.settings.req
        for p_index, (text, ids) in enumerate(st.prompts):
            self.prompt_tokens += len(ids)
            base = None if req.seed is None else req.seed + p_index
            for j in range(st.n):
                s = gen.new_sequence(ids, st.max_tokens, st.temperature, st.top_p, req.top_k, st.stop,
                                     choice_seed(base, j), req.logprobs, self._on_event)
                s.index, s.prompt_text = p_index * st.n + j, text
                self.seqs.append(s)
        self.created = int(time.time())
        scheduler.submit(self.seqs)

    def usage(self) -> dict:
        done = sum(s.counted for s in self.seqs)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    async def finish(self, timeout: float, disconnected) -> dict:
        """Await every choice on the event loop (no thread waits), for at most `timeout` seconds;
        the whole completion object. Past the timeout (503), or once the client is gone
        (`disconnected()`, checked twice a second), the choices are cancelled, freeing the batch."""
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        def wake() -> None:  # called on the scheduler thread, which must never fail for it
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits any more
                loop.call_soon_threadsafe(done.set)

        with self._lock:
            self._waker = wake
            if self._finished == len(self.seqs):
                done.set()
        deadline = loop.time() + timeout
        try:
            while not done.is_set():
                left = deadline - loop.time()
                if left <= 0:
                    raise APIError(503, f"the completion did not finish within this server's request timeout "
                                   f"of {timeout:g}s; ask for fewer tokens or choices", None, "timeout",
                                   "server_error")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(done.wait(), min(left, 0.5))
                if not done.is_set() and await disconnected():
                    raise APIError(499, "the client closed the request", None, "client_closed")
        except BaseException:
            self.cancel()
            raise
        return self.response()

    def response(self) -> dict:
        """Wait for every choice; the whole completion object."""
        remaining = len(self.seqs)
        while remaining:
            if self.events.get()[2]:
                remaining -= 1
        failed = [s.error for s in self.seqs if s.error]
        if failed:
            raise APIError(500, failed[0], None, None, "server_error")
        choices = [self._choice(s, s.result()) for s in self.seqs]
        return {"id": self.cid, "object": self.object_name, "created": self.created, "model": self.model_name,
                "choices": choices, "usage": self.usage()}

    def _choice(self, s: Sequence, c) -> dict:
        return {"text": (s.prompt_text + c.text) if self.settings.echo else c.text, "index": s.index,
                "logprobs": c.logprobs, "finish_reason": c.finish_reason}

    def _preamble(self) -> Iterator[str]:
        return iter(())

    def cancel(self) -> None:
        """Stop generating for this request (its client went away, or it is done)."""
        for s in self.seqs:
            s.cancelled = True

    def _chunk_choice(self, index: int, text: str, finish: str | None, logprobs) -> dict:
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}

    def _chunk(self, index: int, text: str, finish: str | None, logprobs=None) -> str:
        body = {"id": self.cid, "object": self.chunk_object, "created": self.created, "model": self.model_name,
                "choices": [self._chunk_choice(index, text, finish, logprobs)]}
        if self.settings.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def stream(self) -> Iterator[str]:
        """Server-sent events: text deltas as they are generated, a final chunk per choice (with
        its finish reason and logprobs), the usage chunk if asked for, then [DONE]."""
        try:
            yield from self._preamble()
            if self.settings.echo:
                for s in self.seqs:
                    yield self._chunk(s.index, s.prompt_text, None)
            remaining = len(self.seqs)
            while remaining:
                index, delta, finished = self.events.get()
                s = self.seqs[index]
                if not finished:
                    yield self._chunk(index, delta, None)
                    continue
                remaining -= 1
                if s.error:
                    err = error_body(s.error, "server_error")
                    yield f"data: {json.dumps(err)}\n\n"
                    continue
                if delta:
                    yield self._chunk(index, delta, None)
                yield self._chunk(index, "", s.finish or "length", s.result().logprobs)
            if self.settings.include_usage:
                body = {"id": self.cid, "object": self.chunk_object, "created": self.created,
                        "model": self.model_name, "choices": [], "usage": self.usage()}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or we are done): stop generating for it
            for s in self.seqs:
                s.cancelled = True


class ChatJob(CompletionJob):
    """A chat completion: the same generation, answered in OpenAI's chat shapes."""

    id_prefix, object_name, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def _choice(self, s: Sequence, c) -> dict:
        return {"index": s.index, "message": {"role": "assistant", "content": c.text.strip()},
                "logprobs": None, "finish_reason": c.finish_reason}

    def _chunk_choice(self, index: int, text: str, finish: str | None, logprobs) -> dict:
        return {"index": index, "delta": {"content": text} if text or finish is None else {},
                "logprobs": None, "finish_reason": finish}

    def _preamble(self) -> Iterator[str]:
        for s in self.seqs:  # the first chunk of each choice names the role, as OpenAI's do
            body = {"id": self.cid, "object": self.chunk_object, "created": self.created, "model": self.model_name,
                    "choices": [{"index": s.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]}
            yield f"data: {json.dumps(body)}\n\n"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: StrictStr = Field(pattern=r"^(system|developer|user|assistant)$")
    content: StrictStr | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text is understood
            if any(p.get("type") != "text" for p in self.content):
                raise APIError(400, "only text content parts are supported", "messages", "unsupported_value")
            return "".join(str(p.get("text", "")) for p in self.content)
        return self.content or ""


class ChatCompletionRequest(BaseModel):
    """OpenAI's /v1/chat/completions body (text only). Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_PROMPTS)
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, gt=0)
    n: StrictInt | None = Field(default=None, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    logprobs: bool | None = None
    tools: list | None = None
    user: str | None = None


# a base model has no chat template: a plain role-prefixed transcript, ending where the assistant speaks
ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
ROLE_STOPS = ["\nUser:", "\nSystem:"]


def chat_prompt(messages: list[ChatMessage]) -> str:
    return "".join(f"{ROLE_NAMES[m.role]}: {m.text()}\n" for m in messages) + "Assistant:"


def _chat_settings(req: ChatCompletionRequest, gen: TextGenerator, model_name: str, max_tokens_limit: int,
                   max_n: int) -> SamplingSettings:
    if req.tools:
        raise APIError(400, "tools are not supported by this server", "tools", "unsupported_value")
    if req.logprobs:
        raise APIError(400, "logprobs are not supported for chat completions by this server", "logprobs",
                       "unsupported_value")
    prompt = chat_prompt(req.messages)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise APIError(400, f"the messages are longer than {MAX_PROMPT_CHARS} characters", "messages",
                       "invalid_value")
    as_completion = CompletionRequest(
        model=req.model, prompt=prompt, max_tokens=req.max_completion_tokens if req.max_tokens is None else req.max_tokens,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, n=req.n, stop=req.stop, seed=req.seed,
        stream=req.stream, stream_options=req.stream_options, user=req.user)
    settings = _sampling_settings(as_completion, gen, model_name, max_tokens_limit, max_n)
    settings.stop = settings.stop + ROLE_STOPS  # the model must not write the user's next turn
    return settings


def _prompts(req: CompletionRequest, gen: TextGenerator) -> list[tuple[str, list[int]]]:
    """[(prompt text, prompt ids)] from any of OpenAI's prompt forms. OpenAI's default prompt is
    "<|endoftext|>", i.e. the start of a new document: here the empty prompt."""
    p: Any = req.prompt
    if p is None:
        p = ""
    if isinstance(p, str):
        items: list = [p]
    elif not p:
        raise APIError(400, "prompt must not be an empty list", "prompt", "invalid_value")
    elif isinstance(p[0], int):
        items = [list(p)]
    else:
        items = list(p)
    if len(items) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", "prompt", "invalid_value")
    out = []
    for item in items:
        if isinstance(item, str):
            if len(item) > MAX_PROMPT_CHARS:
                raise APIError(400, f"prompt longer than {MAX_PROMPT_CHARS} characters", "prompt", "invalid_value")
            out.append((item, gen.encode(item)))
        else:
            bad = [t for t in item if not 0 <= t < gen.vocab_size]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{gen.vocab_size - 1})",
                               "prompt", "invalid_value")
            out.append((gen.decode(item), list(item)))
    return out


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise APIError(400, "suffix is not supported by this server", "suffix", "unsupported_value")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise APIError(400, "best_of other than n is not supported by this server", "best_of", "unsupported_value")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise APIError(400, f"{name} is not supported by this server", name, "unsupported_value")
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported by this server", "logit_bias", "unsupported_value")
