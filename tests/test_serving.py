"""Serving: KV-cached generation equals the uncached path, streaming (SSE), logprobs, continuous
batching of concurrent requests, bearer auth, fuzzed bad bodies, hot reload of a new champion."""
from __future__ import annotations

import json
import random
import threading

import pytest
import torch
from fastapi.testclient import TestClient

from infra.services.model_server.server import create_app
from lm_helpers import random_checkpoint, sample_tokenizer
from tasks.deploy.generation import TextGenerator
from tasks.train.model import GPT, GPTConfig, KVCache


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    tok = sample_tokenizer(root / "tokenizer.json")
    return {"tokenizer": tok, "ckpt": random_checkpoint(root / "train", tok, 10, 0),
            "ckpt2": random_checkpoint(root / "train", tok, 20, 1)}


@pytest.fixture(scope="module")
def generator(tiny):
    return TextGenerator.from_files(tiny["ckpt"], tiny["tokenizer"])


@pytest.fixture(scope="module")
def client(generator):
    with TestClient(create_app(generator, "m", max_tokens_limit=128, max_n=4, max_batch=16)) as c:
        yield c


def _sse(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ------------------------------------------------------------------------------- KV cache

def test_kv_cache_logits_match_forward():
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16)).eval()
    seqs = [torch.randint(0, 64, (1, n)) for n in (1, 4, 9)]
    caches = [KVCache(m.cfg) for _ in seqs]
    for s, c in zip(seqs, caches):
        torch.testing.assert_close(m.prefill(s, c), m(s)[0][:, -1], rtol=1e-5, atol=1e-5)
    for _ in range(5):  # batched decode of sequences of different lengths
        new = torch.randint(0, 64, (len(seqs),))
        logits = m.decode_step(new, caches)
        seqs = [torch.cat([s, new[i:i + 1, None]], 1) for i, s in enumerate(seqs)]
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], m(s)[0][0, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature,seed,top_k", [(0.0, None, None), (0.9, 3, None), (1.0, 11, 20)])
def test_cached_generation_equals_gpt_generate_past_the_window(generator, temperature, seed, top_k):
    """40 new tokens on a 32-token model: the cache fills, then the window slides (recomputed)."""
    ids = generator.encode("The Linux kernel is")
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    out = generator.model.generate(torch.tensor([ids]), 40, temperature=temperature, top_k=top_k, generator=g)
    want = out[0, len(ids):].tolist()
    (c,) = generator.complete(ids, max_tokens=40, temperature=temperature, top_k=top_k, seed=seed)
    assert c.completion_tokens == 40 and c.text == generator.decode(want)


# ------------------------------------------------------------------------------ streaming

def test_stream_matches_non_stream_and_ends_with_done(client):
    body = {"prompt": ["Debian is", "In Python"], "max_tokens": 12, "temperature": 0, "n": 2}
    full = client.post("/v1/completions", json=body).json()
    r = client.post("/v1/completions", json={**body, "stream": True,
                                              "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(r.text)
    texts, finish = {}, {}
    for ch in chunks[:-1]:
        assert ch["object"] == "text_completion" and ch["id"].startswith("cmpl-") and ch["model"] == "m"
        (c,) = ch["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        if c["finish_reason"]:
            finish[c["index"]] = c["finish_reason"]
    assert [texts[i] for i in range(4)] == [c["text"] for c in full["choices"]]
    assert [finish[i] for i in range(4)] == [c["finish_reason"] for c in full["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]


def test_stream_with_stop_never_leaks_the_stop_string(client):
    free = client.post("/v1/completions", json={"prompt": "The", "max_tokens": 20, "temperature": 0}).json()
    text = free["choices"][0]["text"]
    assert len(text) >= 4
    stop = text[2:4]
    r = client.post("/v1/completions", json={"prompt": "The", "max_tokens": 20, "temperature": 0,
                                              "stop": stop, "stream": True})
    chunks = _sse(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[:text.find(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs(client, generator):
    r = client.post("/v1/completions", json={"prompt": "Debian", "max_tokens": 5, "temperature": 0, "logprobs": 3})
    c = r.json()["choices"][0]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == c["text"] and lp["text_offset"][0] == 0
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and len(top) <= 3 and max(top.values()) == pytest.approx(value)  # greedy = top-1
    ids = generator.encode("Debian")
    with torch.no_grad():
        logits = generator.model(torch.tensor([ids]))[0][0, -1]
    assert lp["token_logprobs"][0] == pytest.approx(float(torch.log_softmax(logits, -1).max()), abs=1e-4)
    zero = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 0}).json()
    assert zero["choices"][0]["logprobs"]["top_logprobs"] is None


# ---------------------------------------------------------------------- continuous batching

def test_concurrent_requests_are_batched_and_equal_sequential(client):
    prompts = [f"prompt {i} The Linux" for i in range(8)]
    want = [client.post("/v1/completions", json={"prompt": p, "max_tokens": 10 + i, "temperature": 0}).json()
            for i, p in enumerate(prompts)]
    got: dict[int, dict] = {}

    def call(i):
        got[i] = client.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 10 + i,
                                                       "temperature": 0}).json()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got[i]["choices"][0]["text"] for i in range(8)] == [w["choices"][0]["text"] for w in want]
    assert client.get("/health").json()["batching"]["max_seen_batch"] > 1


# ------------------------------------------------------------------------ auth and bad input

def test_bearer_auth(generator):
    with pytest.raises(ValueError, match="must not be the clients"):
        create_app(generator, "m", api_key="s3cret", admin_key="s3cret")
    with TestClient(create_app(generator, "m", api_key="s3cret", admin_key="adm1n")) as c:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic s3cret"}):
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
            assert r.status_code == 401
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
        # the admin API takes the admin token only: never the clients' key
        assert c.post("/v1/admin/reload", json={"version": 2}).status_code == 401
        assert c.post("/v1/admin/reload", json={"version": 2},
                      headers={"Authorization": "Bearer s3cret"}).status_code == 401
        no_registry = c.post("/v1/admin/reload", json={"version": 2}, headers={"Authorization": "Bearer adm1n"})
        assert no_registry.status_code == 400 and no_registry.json()["error"]["code"] == "no_registry"
        assert c.get("/health").status_code == 200  # liveness stays open
        ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                    headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def test_admin_api_is_off_without_an_admin_key(generator):
    with TestClient(create_app(generator, "m")) as c:
        r = c.post("/v1/admin/reload", json={"version": 2})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"


def test_request_limits_name_the_limit(generator):
    """A body over the size limit gets 413 before it is parsed, a stream over the concurrency limit 429."""
    with TestClient(create_app(generator, "m", max_body_bytes=2000, max_streams=1)) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 1})
        assert r.status_code == 413 and "2000 bytes" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
        state = c.app.state.crucible
        assert state.streams.acquire(blocking=False)  # a stream in progress holds the only slot
        second = c.post("/v1/completions", json={"prompt": "The", "max_tokens": 2, "stream": True})
        assert second.status_code == 429 and "at most 1 concurrent streams" in second.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "The", "max_tokens": 2}).status_code == 200  # not a stream
        state.streams.release()
        again = c.post("/v1/completions", json={"prompt": "The", "max_tokens": 2, "stream": True})
        assert again.status_code == 200
        assert state.streams.acquire(blocking=False)  # and a finished stream gave its slot back
        state.streams.release()


def test_a_key_variable_that_is_named_but_empty_stops_the_server(tiny):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "EMPTY_KEY": ""}
    r = subprocess.run([sys.executable, "-m", "infra.services.model_server", "--checkpoint", str(tiny["ckpt"]),
                        "--tokenizer", str(tiny["tokenizer"]), "--model-name", "m", "--api-key-env", "EMPTY_KEY",
                        "--port", "1"], env=env, capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode != 0 and "EMPTY_KEY is empty or not set" in r.stderr, r.stderr[-2000:]


def test_fuzzed_bodies_get_4xx_and_server_survives(client):
    rnd = random.Random(0)
    values = [None, 0, -1, 1.5, 10 ** 12, "", "x" * 50, [], [1, "a"], [[1], "a"], {}, {"a": 1}, True, float("inf")]
    fields = ["prompt", "max_tokens", "temperature", "top_p", "n", "stop", "logprobs", "stream", "seed",
              "echo", "top_k", "stream_options", "model"]
    for _ in range(60):
        body = {f: rnd.choice(values) for f in rnd.sample(fields, rnd.randint(1, 5))}
        body.setdefault("max_tokens", 2)
        try:
            content = json.dumps(body)
        except ValueError:
            continue
        r = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    for raw in (b"\xff\xfe", b'{"prompt": "x", "max_tokens": 1e309}', b"[]", b'"str"', b"{" * 1000):
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw[:20], r.text)
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


# ------------------------------------------------------------------------------- hot reload

def test_reload_keeps_in_flight_requests_on_the_old_model(tiny):
    old = TextGenerator.from_files(tiny["ckpt"], tiny["tokenizer"])
    new = TextGenerator.from_files(tiny["ckpt2"], tiny["tokenizer"])
    ids = old.encode("The Linux")
    want_old = old.complete(ids, max_tokens=60, temperature=0)[0].text
    want_new = new.complete(ids, max_tokens=8, temperature=0)[0].text
    registry = {2: tiny["ckpt2"]}  # what the registry resolves (the process test resolves in MLflow)

    def resolve(version, alias):
        return str(registry[version]), str(tiny["tokenizer"]), None, version

    admin = {"Authorization": "Bearer adm1n"}
    with TestClient(create_app(old, "m", max_tokens_limit=128, admin_key="adm1n", resolve_version=resolve,
                               version=1)) as c:
        # a filesystem path is never accepted; an unknown version is a 400 naming it
        path = c.post("/v1/admin/reload", json={"checkpoint": str(tiny["ckpt2"])}, headers=admin)
        assert path.status_code == 400 and path.json()["error"]["param"] == "checkpoint"
        bad = c.post("/v1/admin/reload", json={"version": 7}, headers=admin)
        assert bad.status_code == 400 and "version 7" in bad.json()["error"]["message"]
        with c.stream("POST", "/v1/completions", json={"prompt": "The Linux", "max_tokens": 60,
                                                        "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            rel = c.post("/v1/admin/reload", json={"version": 2}, headers=admin)
            assert rel.status_code == 200 and rel.json() == {"status": "reloaded", "version": 2, "step": 20,
                                                             "previous": 1}
            rest = "\n".join(lines)
        chunks = _sse(first + "\n" + rest)
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == want_old
        assert c.get("/health").json()["step"] == 20
        after = c.post("/v1/completions", json={"prompt": "The Linux", "max_tokens": 8, "temperature": 0}).json()
        assert after["choices"][0]["text"] == want_new


# ----------------------------------------------------------------- the official OpenAI client

def test_the_official_openai_client_models_completions_chat_streaming_and_errors(generator):
    """What most OpenAI-compatible tools speak: the `openai` package against this server."""
    import openai

    app = create_app(generator, "crucible-test", max_tokens_limit=64, max_n=4, api_key="sk-test")
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="sk-test", http_client=http, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["crucible-test"]
        done = client.completions.create(model="crucible-test", prompt="The Linux kernel", max_tokens=5,
                                         temperature=0)
        assert done.object == "text_completion" and done.choices[0].finish_reason in ("length", "stop")
        assert done.usage.completion_tokens > 0
        chat = client.chat.completions.create(
            model="crucible-test", max_tokens=8, temperature=0, n=2, seed=3,
            messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}])
        assert chat.object == "chat.completion" and len(chat.choices) == 2
        assert all(c.message.role == "assistant" and isinstance(c.message.content, str) for c in chat.choices)
        assert "User:" not in chat.choices[0].message.content  # stops before the next turn
        # the transcript the server builds for a base model, and the same greedy text as a completion
        plain = client.completions.create(model="crucible-test", prompt="System: You are terse.\nUser: Hello\n"
                                          "Assistant:", max_tokens=8, temperature=0, stop=["\nUser:", "\nSystem:"])
        greedy = client.chat.completions.create(model="crucible-test", max_tokens=8, temperature=0, messages=[
            {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}])
        assert greedy.choices[0].message.content == plain.choices[0].text.strip()
        stream = client.chat.completions.create(model="crucible-test", max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                messages=[{"role": "user", "content": "Hello"}])
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip() == greedy.choices[0].message.content
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)
        completion_stream = list(client.completions.create(model="crucible-test", prompt="The", max_tokens=3,
                                                           stream=True, temperature=0))
        assert "".join(c.choices[0].text for c in completion_stream)
        # errors come back as the client's exception types
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.chat.completions.create(model="crucible-test", max_tokens=10_000,
                                           messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="crucible-test", messages=[])
        bad_key = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad_key.models.list()


def test_a_stream_slot_comes_back_even_when_the_client_leaves_before_the_first_byte():
    """The slot and the sequences are released by the response itself, not by its body generator
    (which never runs when the client is gone before the response starts)."""
    import asyncio
    import threading

    from infra.services.model_server.server import SlotStream

    class Job:  # the two things SlotStream uses of a completion job
        cancelled = False

        def stream(self):
            yield "data: never read\n\n"

        def cancel(self):
            self.cancelled = True

    slots, job = threading.BoundedSemaphore(1), Job()
    assert slots.acquire(blocking=False)
    response = SlotStream(job, slots)

    async def gone():
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the client is gone")

    try:
        asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST"}, gone, send))
    except Exception:  # noqa: BLE001 - the disconnect surfaces as it may (an exception group under anyio)
        pass
    assert job.cancelled and slots.acquire(blocking=False)  # the slot is free again


def test_a_chunked_body_over_the_limit_is_a_413(generator):
    with TestClient(create_app(generator, "m", max_body_bytes=2000)) as c:
        chunks = (b'{"prompt": "' + b"x" * 1000, b"x" * 1000, b"x" * 1000 + b'", "max_tokens": 1}')
        r = c.post("/v1/completions", content=iter(chunks), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "2000 bytes" in r.json()["error"]["message"], r.text
