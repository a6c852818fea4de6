"""The evaluation task suite (WikiText-2, LAMBADA, HellaSwag, calibration) and the reference-model
comparison, on the tiny checkpoint that lm_helpers trains (shared with test_evaluate.py)."""
from __future__ import annotations

import json
import math
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F

from lm_helpers import EVAL_DIR, tiny_cfg, tokenizer_artifact, tokens_artifact
from tasks.evaluate import evaluate_checkpoint
from tasks.evaluate.reference import CompletionsClient, compare_with_reference, lambada_generate, loglikelihoods
from tasks.evaluate.scoring import LMScorer, rolling_chunks
from tasks.evaluate.suite import (
    count_words,
    eval_lambada,
    eval_wikitext,
    expected_calibration_error,
    load_hellaswag,
    load_lambada,
    load_wikitext_pages,
    multiple_choice_metrics,
    spread_indices,
)
from tasks.train.model import GPT


@pytest.fixture(scope="module")
def tok_path(base, run) -> Path:
    return Path(tokenizer_artifact(base)["path"])


@pytest.fixture(scope="module")
def scorer(run, tok_path) -> LMScorer:
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LMScorer.from_files(run["checkpoints"][-1], tok_path, batch_size=8)
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def random_scorer(scorer) -> LMScorer:
    torch.manual_seed(0)
    return LMScorer(GPT(scorer.model.cfg).eval(), scorer.tok, scorer.eos_id, batch_size=8)


def _direct_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log P(ids[t] | ids[:t]) for t >= 1, one forward pass (len(ids) <= seq_len + 1)."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids[:-1]]))
    return F.log_softmax(logits[0].float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _greedy_target(scorer: LMScorer, context: str) -> str:
    """The model's own greedy next token after `context`, as text: a target it gets right.
    (The 20-step test model's favourite is often a newline rather than a word.)"""
    text = scorer.generate_until(context, max_gen_toks=1)
    assert text and scorer.encode(context + text)[len(scorer.encode(context)):] == scorer.encode(text)
    return text


# ------------------------------------------------------------------------------ windows

def test_rolling_chunks_lm_eval_docstring_example():
    # lm-eval LM.loglikelihood_rolling docstring: tokens 0..9, prefix P, max context 4
    P = -1
    seq = [P] + list(range(10))
    got = [(seq[s:e], seq[e - k + 1:e + 1]) for s, e, k in rolling_chunks(len(seq), 1, 4)]
    assert got == [([P, 0, 1, 2], [0, 1, 2, 3]), ([3, 4, 5, 6], [4, 5, 6, 7]), ([5, 6, 7, 8], [8, 9])]


@pytest.mark.parametrize("n,first,L,stride", [(300, 1, 64, None), (300, 1, 64, 16), (70, 60, 64, None),
                                              (200, 150, 16, None), (5, 1, 64, 1)])
def test_rolling_chunks_predict_each_target_once_within_window(n, first, L, stride):
    seen = []
    for i, (s, e, k) in enumerate(rolling_chunks(n, first, L, stride)):
        assert 0 <= s < e <= n - 1 and e - s <= L and 1 <= k <= e - s
        seen += list(range(e - k + 1, e + 1))
        if i:  # later windows: at least L - stride + 1 tokens of context (or all there are)
            assert (e - k + 1) - s >= min(L - (stride or L) + 1, e - k + 1)
    assert seen == list(range(first, n))


def test_rolling_chunks_match_lm_eval_windows():
    utils = pytest.importorskip("lm_eval.utils")
    tokens = list(range(100, 337))
    for L, stride in [(64, 64), (64, 16), (16, 5), (8, 1)]:
        theirs = list(utils.get_rolling_token_windows(tokens, 0, L, L - stride + 1))
        seq = [0] + tokens
        ours = [(seq[s:e], seq[e - k + 1:e + 1]) for s, e, k in rolling_chunks(len(seq), 1, L, stride)]
        assert ours == [(list(a), list(b)) for a, b in theirs]


# ------------------------------------------------------------------------------ scoring

def test_scorer_equals_direct_log_probs(scorer):
    model = scorer.model
    ctx, cont = "Alice was beginning to get very", " tired of sitting by her sister"
    c_ids, x_ids = scorer.encode_pair(ctx, cont)
    assert c_ids + x_ids == scorer.encode(ctx + cont)
    lp = _direct_logprobs(model, c_ids + x_ids)[len(c_ids) - 1:]
    got = scorer.loglikelihood([(ctx, cont)])[0]
    assert got.n_tokens == len(x_ids)
    assert got.logprob == pytest.approx(float(lp.sum()), abs=1e-4)

    # a text longer than seq_len: disjoint windows, the last one with full context (lm-eval)
    text = (EVAL_DIR / "wikitext-2" / "test.txt").read_text(encoding="utf-8")[:1500]
    ids = [scorer.eos_id] + scorer.encode(text)
    L = scorer.seq_len
    assert len(ids) > 3 * L
    expect = 0.0
    for a in range(1, len(ids), L):  # targets a..b-1
        b = min(len(ids), a + L)
        s = max(0, b - 1 - L)
        expect += float(_direct_logprobs(model, ids[s:b])[-(b - a):].sum())
    rolled = scorer.loglikelihood_rolling([text])[0]
    assert rolled.n_tokens == len(ids) - 1 and rolled.logprob == pytest.approx(expect, abs=1e-3)
    # batching does not change a request's score
    both = scorer.loglikelihood_rolling([text, "short text"])
    assert both[0].logprob == pytest.approx(rolled.logprob, abs=1e-3)


def test_smaller_stride_gives_more_context(scorer):
    text = (EVAL_DIR / "wikitext-2" / "test.txt").read_text(encoding="utf-8")[:3000]
    full = scorer.loglikelihood_rolling([text])[0]
    overlap = scorer.loglikelihood_rolling([text], stride=scorer.seq_len // 4)[0]
    assert overlap.n_tokens == full.n_tokens
    assert overlap.logprob > full.logprob  # each token sees >= 3/4 of a window of context


# -------------------------------------------------------------------------------- tasks

def test_data_loaders():
    pages = load_wikitext_pages(EVAL_DIR / "wikitext-2" / "test.txt")
    assert len(pages) == 62 and pages[0].startswith(" = Robert <unk> = \n \n Robert <unk> is")
    assert sum(count_words(p) for p in pages) >= 241211  # whitespace words of the file (+ ends)
    lam = load_lambada(EVAL_DIR / "lambada_test.jsonl", 5)
    assert [it["index"] for it in lam] == spread_indices(5153, 5) == [0, 1288, 2576, 3864, 5152]
    assert all(it["target"].startswith(" ") and " " not in it["target"][1:] for it in lam)
    first = json.loads((EVAL_DIR / "lambada_test.jsonl").open().readline())["text"]
    assert lam[0]["context"] + lam[0]["target"] == first
    hs = load_hellaswag(EVAL_DIR / "hellaswag_val.jsonl", 3)
    assert hs[0] == {"index": 0, "query": "Roof shingle removal: A man is sitting on a roof. he", "gold": 3,
                     "choices": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                                 "is holding a rubik's cube.", "starts pulling up roofing on a roof."]}
    assert all(len(h["choices"]) == 4 and 0 <= h["gold"] < 4 for h in hs)


def test_trained_model_beats_random_init_on_wikitext(scorer, random_scorer):
    pages = [load_wikitext_pages(EVAL_DIR / "wikitext-2" / "test.txt")[1][:6000]]
    trained = eval_wikitext(scorer, pages)
    rand = eval_wikitext(random_scorer, pages)
    assert trained["tokens"] == rand["tokens"] and trained["words"] == count_words(pages[0])
    # a random init is near-uniform over the 512-token vocabulary
    assert 300 < rand["token_perplexity"] < 900
    assert trained["token_perplexity"] < 0.75 * rand["token_perplexity"]
    assert trained["word_perplexity"] < rand["word_perplexity"]
    assert trained["word_perplexity"] == pytest.approx(
        math.exp(-trained["loglikelihood"] / trained["words"]), rel=1e-9)
    assert trained["bits_per_byte"] == pytest.approx(math.log2(trained["byte_perplexity"]), rel=1e-9)


@pytest.mark.parametrize("which", ["trained", "random"])
def test_lambada_by_hand(which, request):
    # the trained 20-step model's greedy next token is a newline; the random init's a word (" to")
    scorer = request.getfixturevalue("scorer" if which == "trained" else "random_scorer")
    ctx = "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to"
    items = [{"context": ctx, "target": _greedy_target(scorer, ctx)}, {"context": ctx, "target": " zebra"}]
    hand_ll, hand_greedy = [], []
    for it in items:  # by hand: one forward pass over context + target
        c = scorer.encode(it["context"])
        whole = scorer.encode(it["context"] + it["target"])
        x = whole[len(c):]
        with torch.no_grad():
            logits, _ = scorer.model(torch.tensor([whole[:-1]]))
        logp = F.log_softmax(logits[0].float(), -1)[len(c) - 1:]
        hand_ll.append(sum(float(logp[i, t]) for i, t in enumerate(x)))
        hand_greedy.append(all(int(logp[i].argmax()) == t for i, t in enumerate(x)))
    assert hand_greedy == [True, False]
    r = eval_lambada(scorer, items)
    assert r["acc"] == 0.5 and r["n"] == 2
    assert r["perplexity"] == pytest.approx(math.exp(-sum(hand_ll) / 2), rel=1e-4)


def test_multiple_choice_metrics_by_hand():
    items = [{"choices": ["a", "bbbb"], "gold": 1}, {"choices": ["cc", "d"], "gold": 0}]
    # item 1: ll favours "a" (-2 > -4) but per character "bbbb" (-1 > -2); item 2: "cc" both ways
    r = multiple_choice_metrics(items, [[-2.0, -4.0], [-1.0, -3.0]])
    assert r["acc"] == 0.5 and r["acc_norm"] == 1.0 and r["n"] == 2
    p1 = 1 / (1 + math.exp(-2))  # softmax confidence of both predictions
    assert r["mean_confidence"] == pytest.approx(p1)
    assert r["ece"] == pytest.approx(abs(0.5 - p1))  # one bin: accuracy 1/2, confidence p1


def test_expected_calibration_error():
    ece, table = expected_calibration_error([0.95, 0.85, 0.55, 0.3], [1, 0, 1, 0], 10)
    assert ece == pytest.approx((0.05 + 0.85 + 0.45 + 0.3) / 4)
    assert [b["count"] for b in table] == [1, 1, 1, 1] and table[0]["lo"] == 0.2
    ece, _ = expected_calibration_error([0.7] * 10, [1] * 7 + [0] * 3, 10)
    assert ece == pytest.approx(0.0, abs=1e-12)  # calibrated
    assert expected_calibration_error([1.0, 1.0], [0, 0])[0] == pytest.approx(1.0)  # worst case
    ece, table = expected_calibration_error([0.1, 0.2], [1, 1], 10)  # 0.1 falls in (0, 0.1], 0.2 in (0.1, 0.2]
    assert [(b["lo"], b["count"]) for b in table] == [(0.0, 1), (0.1, 1)]
    with pytest.raises(ValueError):
        expected_calibration_error([1.5], [1])


def test_evaluate_checkpoint_runs_suite_and_logs_to_mlflow(base, run, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("suite")).info.run_id
    cfg = tiny_cfg(evaluate={"wikitext": {"limit": 1}, "lambada": {"limit": 20}, "hellaswag": {"limit": 12},
                             "prompts": ["Alice was"]})
    rep = evaluate_checkpoint(cfg, Path(run["checkpoints"][-1]), Path(tokenizer_artifact(base)["path"]),
                              Path(tokens_artifact(base)["index_path"]), tmp_path / "r.json",
                              tracking_uri=uri, run_id=run_id)
    assert {"step", "val_loss", "perplexity", "samples", "report_path", "checkpoint"} <= set(rep)
    t = rep["tasks"]
    assert set(t) == {"wikitext", "lambada", "hellaswag", "calibration"}
    assert t["wikitext"]["documents"] == 1 and t["wikitext"]["word_perplexity"] > t["wikitext"]["token_perplexity"] > 1
    assert t["lambada"]["n"] == 20 and 0 <= t["lambada"]["acc"] <= 1 and t["lambada"]["perplexity"] > 1
    assert t["hellaswag"]["n"] == 12 and 0 <= t["hellaswag"]["acc"] <= 1 and 0 <= t["hellaswag"]["acc_norm"] <= 1
    ece = t["calibration"]["hellaswag"]["ece"]
    assert 0 <= ece <= 1 and sum(b["count"] for b in t["calibration"]["hellaswag"]["reliability"]) == 12
    from tasks.evaluate.evaluate import read_report

    assert read_report(rep["report_path"]) == {k: v for k, v in rep.items() if k != "seconds"}  # signed
    for name, value in [("wikitext_word_perplexity", t["wikitext"]["word_perplexity"]),
                        ("lambada_acc", t["lambada"]["acc"]), ("hellaswag_acc_norm", t["hellaswag"]["acc_norm"]),
                        ("hellaswag_ece", ece), ("val_loss", rep["val_loss"])]:
        hist = client.get_metric_history(run_id, name)
        assert [(m.step, m.value) for m in hist] == [(20, pytest.approx(value, rel=1e-6))], name


def test_tasks_switch_off_and_missing_data(base, run, tmp_path):
    args = (Path(run["checkpoints"][-1]), Path(tokenizer_artifact(base)["path"]),
            Path(tokens_artifact(base)["index_path"]))
    off = {"wikitext": {"enabled": False}, "lambada": {"enabled": False}, "hellaswag": {"enabled": False},
           "prompts": ["Alice was"]}
    rep = evaluate_checkpoint(tiny_cfg(evaluate=off), *args, tmp_path / "off.json")
    assert rep["tasks"] == {"calibration": {"skipped": "no multiple-choice task enabled (calibration uses hellaswag)"}}
    assert rep["task_metrics"] == {}
    missing = {**off, "lambada": {"path": str(tmp_path / "nope.jsonl"), "limit": 3}}
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        evaluate_checkpoint(tiny_cfg(evaluate=missing), *args, tmp_path / "m.json")
    rep = evaluate_checkpoint(tiny_cfg(evaluate={**missing, "on_missing": "skip"}), *args, tmp_path / "m.json")
    assert "not found" in rep["tasks"]["lambada"]["skipped"]
    # an unreachable reference endpoint is reported, and does not fail the checkpoint's evaluation
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    ref = {"enabled": True, "base_url": f"http://127.0.0.1:{closed}/v1", "model": "m", "max_retries": 0,
           "tasks": ["lambada"]}
    rep = evaluate_checkpoint(tiny_cfg(evaluate={**off, "lambada": {"limit": 2}, "reference": ref}), *args,
                              tmp_path / "ref.json")
    assert rep["tasks"]["lambada"]["n"] == 2 and "ConnectError" in rep["reference"]["error"]


def test_reference_config_validation():
    with pytest.raises(Exception, match="base_url and model"):
        tiny_cfg(evaluate={"reference": {"enabled": True}})
    with pytest.raises(Exception, match="NAME of an environment variable"):
        tiny_cfg(evaluate={"reference": {"api_key_env": "sk-live abc"}})


# ------------------------------------------------------------------- reference endpoint

@pytest.fixture(scope="module")
def server(run, tok_path):
    """Crucible's own OpenAI-compatible server (infra.services.model_server's app under uvicorn) in a thread
    of this process, on a free loopback port."""
    import uvicorn

    from tasks.deploy.generation import TextGenerator
    from infra.services.model_server.server import create_app

    app = create_app(TextGenerator.from_files(run["checkpoints"][-1], tok_path), "crucible-test")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not srv.started:
            if not thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the model server did not start")
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["status"] == "ok"
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        srv.should_exit = True
        thread.join(timeout=15)
        sock.close()


def test_reference_against_crucible_server_generation_mode(server, scorer, tmp_path):
    # crafted items: the model's own greedy word (correct) and a wrong word, contexts within seq_len
    contexts = ["The Linux kernel", "Alice was beginning to get very tired of", "In Python, a list"]
    items = []
    for c in contexts:
        items += [{"context": c, "target": _greedy_target(scorer, c)}, {"context": c, "target": " qqqz"}]
    local = eval_lambada(scorer, items)
    assert local["acc"] == 0.5
    with CompletionsClient(server, "crucible-test") as client:
        ref = lambada_generate(client, items, max_tokens=6, batch_size=4)
    assert ref["acc"] == local["acc"] and ref["n"] == len(items) and ref["mode"] == "generate"

    # the whole comparison through the config. auto mode uses echo + logprobs when the server
    # returns log-probs for the echoed prompt, and otherwise falls back to greedy generation
    probe = httpx.post(f"{server}/completions", timeout=30, json={
        "model": "crucible-test", "prompt": "The Linux kernel is", "max_tokens": 1, "echo": True, "logprobs": 1})
    echoes = probe.status_code == 200 and len((probe.json()["choices"][0].get("logprobs") or {})
                                               .get("token_logprobs") or []) > 1
    mode = "logprobs" if echoes else "generate"
    cfg = tiny_cfg(evaluate={"lambada": {"limit": 6}, "hellaswag": {"limit": 4},
                             "reference": {"enabled": True, "base_url": server, "model": "crucible-test",
                                           "batch_size": 4, "hellaswag_max_tokens": 8}})
    local_tasks = {"lambada": eval_lambada(scorer, load_lambada(EVAL_DIR / "lambada_test.jsonl", 6)),
                   "hellaswag": {"acc": 0.25, "acc_norm": 0.5}, "calibration": {"hellaswag": {"ece": 0.4}}}
    cmp = compare_with_reference(cfg, local_tasks)
    assert cmp["tasks"]["lambada"]["mode"] == mode and cmp["tasks"]["lambada"]["n"] == 6
    assert cmp["tasks"]["hellaswag"]["mode"] == mode and cmp["tasks"]["hellaswag"]["n"] == 4
    side = cmp["side_by_side"]
    assert side["lambada_acc"]["crucible"] == local_tasks["lambada"]["acc"]
    assert 0 <= side["lambada_acc"]["reference"] <= 1 and side["lambada_acc"]["reference_mode"] == mode
    assert side["hellaswag_ece"]["crucible"] == 0.4
    if mode == "generate":
        assert side["hellaswag_acc_norm"] == {"crucible": 0.5, "reference": None, "reference_mode": "generate"}
        assert set(cmp["metrics"]) == {"lambada_acc", "hellaswag_acc"}
    else:  # the same model behind the server: the same log-likelihoods as scored here
        pairs = [(c, " of the") for c in contexts]
        with CompletionsClient(server, "crucible-test") as client:
            theirs = loglikelihoods(client, pairs, batch_size=4)
        for (ll, _), s in zip(theirs, scorer.loglikelihood(pairs)):
            assert ll == pytest.approx(s.logprob, abs=1e-3)
        assert 0 <= cmp["metrics"]["hellaswag_ece"] <= 1


def _fake_logprobs_endpoint(scorer: LMScorer, api_key: str, seen: list):
    """An OpenAI-style completions endpoint with echo + logprobs, scoring with the same model."""
    model, L = scorer.model, scorer.seq_len

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(dict(request.headers))
        if request.headers.get("authorization") != f"Bearer {api_key}":
            return httpx.Response(401, json={"error": {"message": "bad key"}})
        body = json.loads(request.content)
        assert body["echo"] is True and body["logprobs"] == 1 and body["max_tokens"] == 1
        choices = []
        for i, prompt in enumerate(body["prompt"]):
            enc = scorer.tok.encode(prompt, add_special_tokens=False)
            ids = enc.ids
            # rows[j]: log-probs of the token after ids[j] (ids[j+1], or the generated one), each
            # with up to L tokens of context, as a server with an L-token window would give them
            rows = [None] * len(ids)
            with torch.no_grad():
                for s, e, k in rolling_chunks(len(ids) + 1, 1, L):
                    logits, _ = model(torch.tensor([ids[s:e]]))
                    for j in range(e - k, e):
                        rows[j] = F.log_softmax(logits[0, j - s].float(), -1)
            gen = int(rows[-1].argmax())
            offsets = [start for start, _ in enc.offsets] + [len(prompt)]
            token_lp = [None] + [float(rows[j - 1][t]) for j, t in enumerate(ids) if j] + [float(rows[-1][gen])]
            top = [None] + [{scorer.decode([int(r.argmax())]): float(r.max())} for r in rows]
            choices.append({"index": i, "text": prompt + scorer.decode([gen]), "finish_reason": "length",
                            "logprobs": {"tokens": [scorer.decode([t]) for t in ids + [gen]],
                                         "token_logprobs": token_lp, "top_logprobs": top, "text_offset": offsets}})
        return httpx.Response(200, json={"object": "text_completion", "choices": choices})

    return httpx.MockTransport(handler)


def test_reference_logprobs_mode_equals_local_scores(scorer, monkeypatch, caplog, tmp_path):
    key = "sk-test-do-not-log-123"
    monkeypatch.setenv("REF_TEST_KEY", key)
    seen: list = []
    ctx = "Alice was beginning to get very tired of sitting by her sister"
    pairs = [(ctx, " on the bank"), (ctx, " and of having"), ("The Linux kernel", " is"),
             ("The Linux kernel", _greedy_target(scorer, "The Linux kernel"))]
    local = scorer.loglikelihood(pairs)
    client = CompletionsClient("http://ref.invalid/v1", "ref-model", key,
                               transport=_fake_logprobs_endpoint(scorer, key, seen))
    ref = loglikelihoods(client, pairs, batch_size=3)
    assert [g for _, g in ref] == [s.is_greedy for s in local] and ref[-1][1] is True
    for (ll, _), s in zip(ref, local):
        assert ll == pytest.approx(s.logprob, abs=1e-3)

    # through the config: the key comes from the env var it names, and appears nowhere in the result
    cfg = tiny_cfg(evaluate={"lambada": {"limit": 4}, "hellaswag": {"limit": 3},
                             "reference": {"enabled": True, "base_url": "http://ref.invalid/v1", "model": "ref-model",
                                           "api_key_env": "REF_TEST_KEY", "batch_size": 8}})
    caplog.set_level("DEBUG")
    cmp = compare_with_reference(cfg, {"lambada": {"acc": 0.0, "perplexity": 9.0}},
                                 transport=_fake_logprobs_endpoint(scorer, key, seen))
    assert cmp["tasks"]["lambada"]["mode"] == "logprobs" and cmp["tasks"]["hellaswag"]["mode"] == "logprobs"
    assert set(cmp["metrics"]) == {"lambada_acc", "lambada_perplexity", "hellaswag_acc", "hellaswag_acc_norm",
                                   "hellaswag_ece"}
    assert 0 <= cmp["metrics"]["hellaswag_ece"] <= 1
    assert seen and all(h["authorization"] == f"Bearer {key}" for h in seen)
    assert cmp["side_by_side"]["lambada_perplexity"]["crucible"] == 9.0
    assert key not in json.dumps(cmp) and key not in caplog.text
