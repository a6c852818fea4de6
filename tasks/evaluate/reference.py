"""Reference-model comparison through any OpenAI-compatible /v1/completions endpoint.

The same LAMBADA and HellaSwag subsets as the task suite (same files, same `limit`, same evenly
spread indices) are scored by the endpoint's model and reported beside the checkpoint's numbers.

Two ways of scoring, chosen by cfg.evaluate.reference.mode:

logprobs  As lm-eval's completions models do: the prompt is context + continuation with echo=true,
          logprobs=1, max_tokens=1, temperature=0. The continuation's log-likelihood is the sum of
          the echoed prompt tokens that overlap the continuation (located by `text_offset`; the
          generated token is ignored) and is_greedy holds when each of those tokens is the top-1
          entry of top_logprobs. An answer whose logprobs do not cover the echoed prompt (servers
          that echo the text but give logprobs of generated tokens only) counts as "no logprobs". This gives the same metrics as the local suite (LAMBADA acc and
          perplexity, HellaSwag acc, acc_norm and ECE), with the endpoint's own tokenizer.
generate  For endpoints without echo/logprobs (Crucible's own server, most chat-era APIs): greedy
          generation (temperature 0).
            LAMBADA   correct when the generated text starts with " " + target word; this is the
                      greedy criterion of the logprobs mode, up to how the greedy tokens spell it.
            HellaSwag a crude proxy, not comparable with log-likelihood accuracy: the predicted
                      ending is the one sharing the longest character prefix with the generated
                      text (no shared prefix: no prediction, counted wrong). No acc_norm, no ECE.
auto      logprobs, falling back to generate when the endpoint refuses or omits logprobs.

The API key is read from the environment variable NAMED by cfg.evaluate.reference.api_key_env and
sent only in the Authorization header: it is never logged, stored in the report or put in errors.
"""
from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import httpx

from tasks.evaluate.scoring import perplexity
from tasks.evaluate.suite import load_hellaswag, load_lambada, multiple_choice_metrics

log = logging.getLogger(__name__)

# metrics put side by side with the checkpoint's (task, metric)
COMPARED = {"lambada": ("acc", "perplexity"), "hellaswag": ("acc", "acc_norm", "ece")}


class EndpointError(RuntimeError):
    """A request the endpoint answered with an error (status) or that could not be sent (status None)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class LogprobsUnsupported(EndpointError):
    """The endpoint refuses echo/logprobs, or its answer has no usable logprobs."""


class CompletionsClient:
    """A minimal client of POST {base_url}/completions (OpenAI legacy completions API)."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 120.0,
                 max_retries: int = 2, transport: httpx.BaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_retries = max_retries
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "CompletionsClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def complete(self, **body) -> dict:
        body = {"model": self.model, **body}
        for attempt in range(self.max_retries + 1):
            try:
                r = self._http.post("/completions", json=body)
            except httpx.TransportError as e:  # the message names the URL, never the headers
                if attempt < self.max_retries:
                    time.sleep(0.5 * 2 ** attempt)
                    continue
                raise EndpointError(f"{self.base_url}/completions: {type(e).__name__}: {e}") from None
            if (r.status_code == 429 or r.status_code >= 500) and attempt < self.max_retries:
                time.sleep(0.5 * 2 ** attempt)
                continue
            if r.status_code >= 400:
                raise EndpointError(f"{self.base_url}/completions answered {r.status_code}: {_error_message(r)}",
                                    r.status_code)
            data = r.json()
            if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
                raise EndpointError(f"{self.base_url}/completions: no choices in the answer")
            return data
        raise AssertionError("unreachable")


def _error_message(r: httpx.Response) -> str:
    try:
        err = r.json().get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        return str(msg)[:300]
    except Exception:  # noqa: BLE001 - any non-JSON body
        return r.text[:300]


def _ordered_choices(data: dict, n: int) -> list[dict]:
    choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise EndpointError(f"asked for {n} completions, got {len(choices)}")
    return choices


# --------------------------------------------------------------------------- logprobs mode

def continuation_logprob(choice: dict, context: str, prompt: str) -> tuple[float, bool]:
    """(sum of log-probs of the echoed tokens overlapping prompt[len(context):], all greedy)."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not lp.get("token_logprobs") or lp.get("text_offset") is None:
        raise LogprobsUnsupported("the answer has no echoed token_logprobs / text_offset")
    offsets, values = lp["text_offset"], lp["token_logprobs"]
    top = lp.get("top_logprobs") or [None] * len(values)
    # Some servers honour echo for the text only and return logprobs of the generated tokens alone
    # (offsets from 0 in the completion): refuse those rather than misread them as prompt tokens.
    echoed = [i for i, off in enumerate(offsets) if off < len(prompt)]
    if len(echoed) < 2 or offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:len(echoed)])):
        raise LogprobsUnsupported("the logprobs do not cover the echoed prompt")
    tokens = lp.get("tokens")
    if isinstance(tokens, list) and len(tokens) == len(values) and all(isinstance(t, str) for t in tokens) \
            and not any(t.startswith("bytes:") or "\ufffd" in t for t in tokens) \
            and "".join(tokens[i] for i in echoed) != prompt:  # checked when tokens are whole characters
        raise LogprobsUnsupported("the echoed tokens do not spell the prompt")
    total, greedy, n = 0.0, True, 0
    for i, (off, v) in enumerate(zip(offsets, values)):
        if off >= len(prompt):
            break  # generated, not echoed
        end = offsets[i + 1] if i + 1 < len(offsets) else len(prompt)
        if min(end, len(prompt)) <= len(context):
            continue  # a context token
        if v is None:
            raise LogprobsUnsupported("no log-prob for a continuation token")
        total += v
        n += 1
        if top[i]:
            greedy = greedy and v >= max(top[i].values()) - 1e-6
        else:
            greedy = False
    if n == 0:
        raise LogprobsUnsupported("no echoed token covers the continuation")
    return total, greedy


def loglikelihoods(client: CompletionsClient, pairs: list[tuple[str, str]], batch_size: int
                   ) -> list[tuple[float, bool]]:
    out = []
    for i in range(0, len(pairs), batch_size):
        batch = pairs[i:i + batch_size]
        prompts = [c + x for c, x in batch]
        try:
            data = client.complete(prompt=prompts, max_tokens=1, temperature=0, echo=True, logprobs=1)
        except EndpointError as e:
            if e.status is not None and 400 <= e.status < 500 and e.status not in (401, 403, 404, 429):
                raise LogprobsUnsupported(str(e), e.status) from None
            raise
        for (c, _), p, ch in zip(batch, prompts, _ordered_choices(data, len(batch))):
            out.append(continuation_logprob(ch, c, p))
    return out


def lambada_logprobs(client: CompletionsClient, items: list[dict], batch_size: int) -> dict:
    res = loglikelihoods(client, [(it["context"], it["target"]) for it in items], batch_size)
    n = len(res)
    return {"mode": "logprobs", "acc": sum(g for _, g in res) / n if n else float("nan"),
            "perplexity": perplexity(sum(ll for ll, _ in res), n), "n": n}


def hellaswag_logprobs(client: CompletionsClient, items: list[dict], batch_size: int, bins: int) -> dict:
    pairs = [(it["query"], " " + c) for it in items for c in it["choices"]]
    flat = [ll for ll, _ in loglikelihoods(client, pairs, batch_size)]
    lls, k = [], 0
    for it in items:
        lls.append(flat[k:k + len(it["choices"])])
        k += len(it["choices"])
    mc = multiple_choice_metrics(items, lls, bins)
    return {"mode": "logprobs", "acc": mc["acc"], "acc_norm": mc["acc_norm"], "ece": mc["ece"],
            "mean_confidence": mc["mean_confidence"], "n": mc["n"]}


# --------------------------------------------------------------------------- generate mode

def generations(client: CompletionsClient, prompts: list[str], max_tokens: int, batch_size: int,
                stop: list[str] | None = None) -> list[str]:
    out = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        body = {"prompt": batch, "max_tokens": max_tokens, "temperature": 0}
        if stop:
            body["stop"] = stop
        data = client.complete(**body)
        out += [str(ch.get("text") or "") for ch in _ordered_choices(data, len(batch))]
    return out


def lambada_generate(client: CompletionsClient, items: list[dict], max_tokens: int, batch_size: int) -> dict:
    texts = generations(client, [it["context"] for it in items], max_tokens, batch_size)
    hits = [t.startswith(it["target"]) for it, t in zip(items, texts)]
    n = len(hits)
    return {"mode": "generate", "acc": sum(hits) / n if n else float("nan"), "perplexity": None, "n": n}


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def hellaswag_generate(client: CompletionsClient, items: list[dict], max_tokens: int, batch_size: int) -> dict:
    texts = generations(client, [it["query"] for it in items], max_tokens, batch_size, stop=["\n"])
    correct = abstained = 0
    for it, t in zip(items, texts):
        t = t.lstrip()
        overlap = [_common_prefix(t, c) for c in it["choices"]]
        best = max(overlap)
        if best == 0:
            abstained += 1
            continue
        correct += overlap.index(best) == it["gold"]
    n = len(items)
    return {"mode": "generate", "acc": correct / n if n else float("nan"), "acc_norm": None, "ece": None,
            "abstained": abstained, "n": n}


# ------------------------------------------------------------------------------------ entry

def api_key_from_env(name: str | None) -> str | None:
    if not name:
        return None
    key = os.environ.get(name)
    if not key:
        raise EndpointError(f"evaluate.reference.api_key_env names {name}, which is not set")
    return key


def reference_scores(cfg, client: CompletionsClient | None = None,
                     transport: httpx.BaseTransport | None = None) -> dict:
    """Score the suite's LAMBADA / HellaSwag subsets with the reference endpoint (a client built
    from cfg.evaluate.reference unless one is given; `transport` is passed to it, e.g. for tests).

    Returns {"base_url", "model", "tasks": {name: {"mode", metrics...}}, "metrics": {flat}}."""
    rcfg, ecfg = cfg.evaluate.reference, cfg.evaluate
    own = client is None
    if own:
        client = CompletionsClient(rcfg.base_url, rcfg.model, api_key_from_env(rcfg.api_key_env),
                                   rcfg.timeout, rcfg.max_retries, transport)
    mode = rcfg.mode
    tasks: dict[str, dict] = {}
    try:
        for name in rcfg.tasks:
            task_cfg = getattr(ecfg, name)
            path = Path(cfg.resolve_uri(task_cfg.path))
            if not path.is_file():
                tasks[name] = {"skipped": f"data file not found: {path}"}
                continue
            t0 = time.perf_counter()
            if name == "lambada":
                items = load_lambada(path, task_cfg.limit)
                run_lp = lambda: lambada_logprobs(client, items, rcfg.batch_size)  # noqa: E731
                run_gen = lambda: lambada_generate(client, items, rcfg.lambada_max_tokens, rcfg.batch_size)  # noqa: E731
            else:
                items = load_hellaswag(path, task_cfg.limit)
                run_lp = lambda: hellaswag_logprobs(client, items, rcfg.batch_size, ecfg.calibration.bins)  # noqa: E731
                run_gen = lambda: hellaswag_generate(client, items, rcfg.hellaswag_max_tokens, rcfg.batch_size)  # noqa: E731
            if mode in ("auto", "logprobs"):
                try:
                    tasks[name] = run_lp()
                    mode = "logprobs"  # the endpoint does logprobs: keep using them
                except LogprobsUnsupported as e:
                    if rcfg.mode == "logprobs":
                        raise
                    log.info("reference %s: no logprobs (%s); using greedy generation", rcfg.model, e)
                    mode = "generate"
            if mode == "generate":
                tasks[name] = run_gen()
            tasks[name]["seconds"] = round(time.perf_counter() - t0, 3)
    finally:
        if own:
            client.close()
    metrics = {f"{name}_{m}": tasks[name][m] for name, ms in COMPARED.items() if name in tasks
               for m in ms if isinstance(tasks[name].get(m), (int, float))}
    return {"base_url": rcfg.base_url, "model": rcfg.model, "tasks": tasks, "metrics": metrics}


def compare_with_reference(cfg, local_tasks: dict, client: CompletionsClient | None = None,
                           transport: httpx.BaseTransport | None = None) -> dict:
    """reference_scores plus "side_by_side": {"lambada_acc": {"crucible": x, "reference": y}, ...}
    for the metrics both sides have (local numbers from the suite's report["tasks"])."""
    ref = reference_scores(cfg, client, transport)
    local = {"lambada": local_tasks.get("lambada", {}), "hellaswag": dict(local_tasks.get("hellaswag", {}))}
    cal = local_tasks.get("calibration", {}).get("hellaswag")
    if cal:
        local["hellaswag"]["ece"] = cal["ece"]
    side = {}
    for name, ms in COMPARED.items():
        if name not in ref["tasks"] or "skipped" in ref["tasks"][name]:
            continue
        for m in ms:
            mine, theirs = local[name].get(m), ref["tasks"][name].get(m)
            if theirs is None and mine is None:
                continue
            side[f"{name}_{m}"] = {"crucible": _num(mine), "reference": _num(theirs),
                                   "reference_mode": ref["tasks"][name].get("mode")}
    ref["side_by_side"] = side
    return ref


def _num(x):
    return x if isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x)) else None
