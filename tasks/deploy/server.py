"""An OpenAI-compatible completion server for a Crucible checkpoint.

    python -m tasks.deploy.server --checkpoint DIR --tokenizer tokenizer.json --model-name NAME \\
        [--host 127.0.0.1] [--port 8600]

Endpoints:
    POST /v1/completions   prompt (string, list of strings, token ids), max_tokens, temperature,
                           top_p, stop, n, seed, echo, logprobs (0..5), stream (server-sent events
                           in OpenAI's chunk format, ending with `data: [DONE]`; stream_options
                           include_usage; with logprobs, a choice's logprobs come in its
                           final chunk, the one with finish_reason); top_k as an extension.
    GET  /v1/models        the one served model;  GET /v1/models/{id}
    POST /v1/admin/reload  {"checkpoint": DIR, "tokenizer": optional tokenizer.json}: load a new
                           checkpoint and serve it; requests already admitted finish on the old one.
    GET  /health           {"status": "ok", model, checkpoint, step, batching stats, ...}

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: malformed or
unsupported requests get 400, an unknown model 404, a missing/wrong bearer token 401 (when the
server has an API key: --api-key-env NAME names the environment variable holding it); nothing a
client sends stops the server.

Generation is continuously batched (tasks.deploy.scheduler): one thread steps all active
sequences together with a KV cache and admits new requests between steps.
"""
from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import logging
import os
import queue
import sys
import threading
import time
import uuid
from typing import Any, Union

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from tasks.deploy.generation import Sequence, TextGenerator, choice_seed
from tasks.deploy.scheduler import BatchScheduler

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
    model_config = ConfigDict(extra="forbid")

    checkpoint: StrictStr
    tokenizer: StrictStr | None = None


def _loc_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # pydantic appends the union member tried (e.g. "str", "list[int]") to the location; drop those
    keep = [p for p in parts if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool")]
    return ".".join(keep) if keep else None


class ServerState:
    """The generator being served (swapped by /v1/admin/reload) and the batching scheduler."""

    def __init__(self, generator: TextGenerator, max_batch: int):
        self.generator = generator
        self.scheduler = BatchScheduler(max_batch)
        self.reload_lock = threading.Lock()
        self.reloads = 0


def create_app(generator: TextGenerator, model_name: str, max_tokens_limit: int = 1024, max_n: int = 16,
               api_key: str | None = None, max_batch: int = 32) -> FastAPI:
    state = ServerState(generator, max_batch)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        state.scheduler.shutdown()

    app = FastAPI(title="Crucible model server", version="1", docs_url="/docs", redoc_url=None, lifespan=lifespan)
    app.state.crucible = state
    created = int(generator.loaded_at)
    started = time.time()

    def require_key(request: Request) -> None:
        if not api_key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            msg = ("You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'." if not auth
                   else "Incorrect API key provided.")
            raise APIError(401, msg, None, "invalid_api_key")

    auth = [Depends(require_key)]

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
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(error_body(str(e.detail), param=None, code=code), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(f"internal server error: {type(e).__name__}", "server_error"),
                            status_code=500)

    def _model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "crucible",
                "root": state.generator.checkpoint, "max_model_len": state.generator.seq_len}

    @app.get("/health")
    def health() -> dict:
        g = state.generator
        return {"status": "ok", "model": model_name, "checkpoint": g.checkpoint,
                "step": g.meta.get("step"), "seq_len": g.seq_len, "vocab_size": g.vocab_size,
                "uptime_s": round(time.time() - started, 1), "reloads": state.reloads,
                "batching": state.scheduler.stats(), "auth": bool(api_key)}

    @app.get("/v1/models", dependencies=auth)
    def list_models() -> dict:
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    def get_model(model_id: str) -> dict:
        if model_id != model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", "model", "model_not_found")
        return _model_card()

    @app.post("/v1/admin/reload", dependencies=auth)
    def reload(req: ReloadRequest) -> dict:
        """Load a checkpoint and make it the served model. Sequences already admitted keep the
        generator they were encoded with and finish on it."""
        with state.reload_lock:
            old = state.generator
            tokenizer = req.tokenizer or old.tokenizer_path
            try:
                new = TextGenerator.from_files(req.checkpoint, tokenizer)
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                raise APIError(400, f"cannot load {req.checkpoint}: {type(e).__name__}: {e}", "checkpoint",
                               "invalid_value") from None
            state.generator = new
            state.reloads += 1
        log.info("reloaded: now serving %s (step %s), was %s", new.checkpoint, new.meta.get("step"), old.checkpoint)
        return {"status": "reloaded", "checkpoint": new.checkpoint, "step": new.meta.get("step"),
                "previous": old.checkpoint}

    @app.post("/v1/completions", dependencies=auth)
    def completions(req: CompletionRequest):
        gen = state.generator  # one generator for the whole request, even if a reload happens meanwhile
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
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p

        events: queue.Queue = queue.Queue()

        def on_event(seq: Sequence, delta: str, finished: bool) -> None:
            events.put((seq.index, delta, finished))

        seqs: list[Sequence] = []
        prompt_tokens = 0
        for p_index, (text, ids) in enumerate(prompts):
            prompt_tokens += len(ids)
            base = None if req.seed is None else req.seed + p_index
            for j in range(n):
                s = gen.new_sequence(ids, max_tokens, temperature, top_p, req.top_k, stop, choice_seed(base, j),
                                     req.logprobs, on_event)
                s.index, s.prompt_text = p_index * n + j, text
                seqs.append(s)
        cid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        state.scheduler.submit(seqs)

        def usage() -> dict:
            done = sum(s.counted for s in seqs)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}

        if not req.stream:
            remaining = len(seqs)
            while remaining:
                if events.get()[2]:
                    remaining -= 1
            failed = [s.error for s in seqs if s.error]
            if failed:
                raise APIError(500, failed[0], None, None, "server_error")
            choices = []
            for s in seqs:
                c = s.result()
                choices.append({"text": (s.prompt_text + c.text) if echo else c.text, "index": s.index,
                                "logprobs": c.logprobs, "finish_reason": c.finish_reason})
            return {"id": cid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": choices, "usage": usage()}

        def chunk(index: int, text: str, finish: str | None, logprobs=None) -> str:
            body = {"id": cid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def stream():
            try:
                if echo:
                    for s in seqs:
                        yield chunk(s.index, s.prompt_text, None)
                remaining = len(seqs)
                while remaining:
                    index, delta, finished = events.get()
                    s = seqs[index]
                    if not finished:
                        yield chunk(index, delta, None)
                        continue
                    remaining -= 1
                    if s.error:
                        err = error_body(s.error, "server_error")
                        yield f"data: {json.dumps(err)}\n\n"
                        continue
                    if delta:
                        yield chunk(index, delta, None)
                    yield chunk(index, "", s.finish or "length", s.result().logprobs)
                if include_usage:
                    body = {"id": cid, "object": "text_completion", "created": now, "model": model_name,
                            "choices": [], "usage": usage()}
                    yield f"data: {json.dumps(body)}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or we are done): stop generating for it
                for s in seqs:
                    s.cancelled = True

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tasks.deploy.server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="checkpoint directory (tasks.train.checkpoint layout)")
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json")
    ap.add_argument("--model-name", required=True, help="the model id clients send and /v1/models lists")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8600)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--max-tokens-limit", type=int, default=1024)
    ap.add_argument("--max-n", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=32,
                    help="sequences decoded together (continuous batching); 1 = one at a time")
    ap.add_argument("--api-key-env", default=None,
                    help="name of the environment variable holding the bearer token clients must send")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch
    import uvicorn

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    generator = TextGenerator.from_files(args.checkpoint, args.tokenizer)
    log.info("loaded %s (step %s, %d parameters) in %.1fs", args.checkpoint, generator.meta.get("step"),
             sum(p.numel() for p in generator.model.parameters()), time.perf_counter() - t0)
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env) or None
        if api_key is None:
            log.warning("--api-key-env %s is not set: the server accepts requests without a key", args.api_key_env)
    app = create_app(generator, args.model_name, args.max_tokens_limit, args.max_n, api_key=api_key,
                     max_batch=args.max_batch)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


if __name__ == "__main__":
    sys.exit(main())
