"""The lm-evaluation-harness adapter (tasks.evaluate.lm_eval_adapter.CrucibleLM).

The request semantics are tested directly (no lm-eval needed): each method's answer is recomputed
from the model's own log-probabilities. When lm-eval is installed, lm-eval's `simple_evaluate`
also runs offline on LOCAL task YAMLs (LAMBADA subset, WikiText pages as JSONL in tmp_path) and
must agree with the built-in suite on the same items.
"""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lm_helpers import EVAL_DIR, tokenizer_artifact
from tasks.evaluate.lm_eval_adapter import HAVE_LM_EVAL, CrucibleLM
from tasks.evaluate.scoring import LMScorer
from tasks.evaluate.suite import eval_lambada, eval_wikitext, load_lambada, load_wikitext_pages
from tasks.train.model import GPT


@pytest.fixture(scope="module")
def paths(base, run) -> dict:
    return {"checkpoint": run["checkpoints"][-1], "tokenizer": tokenizer_artifact(base)["path"]}


@pytest.fixture(scope="module")
def lm(paths) -> CrucibleLM:
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield CrucibleLM(checkpoint=paths["checkpoint"], tokenizer=paths["tokenizer"], batch_size=4)
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def random_lm(lm) -> CrucibleLM:
    """A random init: unlike the 20-step model (which mostly predicts newlines) it greedily says words."""
    torch.manual_seed(0)
    s = lm.scorer
    return CrucibleLM(scorer=LMScorer(GPT(s.model.cfg).eval(), s.tok, s.eos_id, batch_size=4))


def _req(*args):
    return SimpleNamespace(args=tuple(args))  # what lm-eval's Instance offers: .args


def _direct(model, ids: list[int], n_targets: int) -> tuple[float, bool]:
    """Sum of log P(ids[t] | ids[:t]) over the last n_targets tokens, and whether each is the argmax."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids[:-1]]))
    logp = F.log_softmax(logits[0].float(), -1)[-n_targets:]
    tgt = torch.tensor(ids[-n_targets:])
    return float(logp.gather(-1, tgt[:, None]).sum()), bool((logp.argmax(-1) == tgt).all())


def test_loglikelihood_equals_direct_log_probs(lm, random_lm):
    for model_lm in (lm, random_lm):
        s = model_lm.scorer
        ctx = "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to"
        greedy = s.generate_until(ctx, max_gen_toks=1)
        requests = [_req(ctx, " do"), _req(ctx, greedy), ("The Linux kernel", " is a"), _req("", "The Linux kernel")]
        got = model_lm.loglikelihood(requests)
        assert all(isinstance(ll, float) and isinstance(g, bool) for ll, g in got)
        for (ll, g), r in zip(got, requests):
            c, x = r.args if hasattr(r, "args") else r
            ctx_ids = s.encode(c) if c else [s.eos_id]  # empty context: conditioned on EOS
            cont_ids = s.encode(c + x)[len(s.encode(c)):] if c else s.encode(x)
            want_ll, want_g = _direct(s.model, ctx_ids + cont_ids, len(cont_ids))
            assert ll == pytest.approx(want_ll, abs=1e-4) and g == want_g
        assert got[1][1] is True and got[0][1] is False
    # a trailing space of the context belongs to the continuation (lm-eval's _encode_pair)
    a, b = lm.loglikelihood([_req("The Linux ", "kernel"), _req("The Linux", " kernel")])
    assert a == pytest.approx(b, abs=1e-6)


def test_loglikelihood_truncates_long_context_on_the_left(lm):
    s, L = lm.scorer, lm.scorer.seq_len
    ctx = load_lambada(EVAL_DIR / "lambada_test.jsonl", 1)[0]["context"]
    c_ids, x_ids = s.encode_pair(ctx, " bank")
    assert len(c_ids) > 2 * L
    want, _ = _direct(s.model, (c_ids + x_ids)[-(L + 1):], len(x_ids))  # lm-eval: last seq_len + 1 tokens
    (ll, _), = lm.loglikelihood([_req(ctx, " bank")])
    assert ll == pytest.approx(want, abs=1e-4)


def test_loglikelihood_rolling_equals_direct_log_probs(lm):
    s, L = lm.scorer, lm.scorer.seq_len
    short = "The Linux kernel is a free and open source"
    ids = [s.eos_id] + s.encode(short)
    assert len(ids) <= L + 1
    long_text = load_wikitext_pages(EVAL_DIR / "wikitext-2" / "test.txt")[3][:1200]
    lids = [s.eos_id] + s.encode(long_text)
    n = len(lids) - 1
    assert n > 2 * L
    # lm-eval's windows: disjoint blocks of L predictions; the last, partial one with a full context
    want_long, start = 0.0, 1
    while start <= n:
        end = min(n + 1, start + L)  # predict lids[start:end]
        want_long += _direct(lm.scorer.model, lids[max(0, end - 1 - L):end], end - start)[0]
        start = end
    got = lm.loglikelihood_rolling([_req(short), (long_text,)])
    assert all(isinstance(x, float) for x in got)
    assert got[0] == pytest.approx(_direct(s.model, ids, len(ids) - 1)[0], abs=1e-4)
    assert got[1] == pytest.approx(want_long, abs=1e-3)


def test_generate_until(random_lm):
    s = random_lm.scorer
    ctx = "Alice was beginning to get very tired of"
    ids = s.encode(ctx)
    with torch.no_grad():
        full = s.model.generate(torch.tensor([ids]), 12, temperature=0.0, eos_id=s.eos_id)
    greedy = s.decode(full[0, len(ids):].tolist())
    assert len(greedy) > 6
    out = random_lm.generate_until([
        _req(ctx, {"until": [], "max_gen_toks": 12}),
        _req(ctx, {"until": [greedy[3:6]], "max_gen_toks": 12}),  # cut before the stop string
        _req(ctx, {"until": "\u2603", "max_gen_toks": 4}),  # a str until; stops at max_gen_toks
        (ctx, {"until": [greedy[3:6]], "max_gen_toks": 12, "do_sample": False, "temperature": 0.0}),
    ])
    assert out[0] == greedy
    assert out[1] == greedy[:greedy.index(greedy[3:6])] and out[3] == out[1]
    assert out[2] == s.decode(full[0, len(ids):len(ids) + 4].tolist())
    assert random_lm.generate_until([_req("", {"max_gen_toks": 3})])[0] == s.decode(
        s.model.generate(torch.tensor([[s.eos_id]]), 3, temperature=0.0, eos_id=s.eos_id)[0, 1:].tolist())


def test_plain_class_without_lm_eval(lm):
    if HAVE_LM_EVAL:
        import lm_eval.api.model
        import lm_eval.api.registry

        assert isinstance(lm, lm_eval.api.model.LM)
        assert lm_eval.api.registry.get_model("crucible") is CrucibleLM
    else:
        assert CrucibleLM.__bases__ == (object,)
    with pytest.raises(ValueError, match="checkpoint"):
        CrucibleLM()


# ------------------------------------------------------------------- lm-eval, offline

LAMBADA_YAML = """task: crucible_lambada_local
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

WIKITEXT_YAML = """task: crucible_wikitext_local
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{page}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def test_lm_eval_simple_evaluate_offline_with_local_tasks(lm, random_lm, paths, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    for k, v in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}.items():
        monkeypatch.setenv(k, v)
    import lm_eval
    from lm_eval.tasks import TaskManager

    # LAMBADA: 5 real items plus one whose last word is the random model's greedy choice
    items = load_lambada(EVAL_DIR / "lambada_test.jsonl", 5)
    ctx = "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to"
    word = random_lm.scorer.generate_until(ctx, max_gen_toks=1)
    assert word.startswith(" ") and len(word.split()) == 1
    texts = [it["context"] + it["target"] for it in items] + [ctx + word]
    (tmp_path / "lambada.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pages = [p[:2500] for p in load_wikitext_pages(EVAL_DIR / "wikitext-2" / "test.txt")[:3]]
    (tmp_path / "wikitext.jsonl").write_text("".join(json.dumps({"page": p}) + "\n" for p in pages))
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    cache = tmp_path / "hf_datasets"
    (tasks_dir / "lambada.yaml").write_text(LAMBADA_YAML.format(data=tmp_path / "lambada.jsonl", cache=cache))
    (tasks_dir / "wikitext.yaml").write_text(WIKITEXT_YAML.format(data=tmp_path / "wikitext.jsonl", cache=cache))
    tm = TaskManager(include_path=str(tasks_dir), include_defaults=False)

    # a model object (the random init, which gets the crafted item right)
    res = lm_eval.simple_evaluate(model=random_lm, tasks=["crucible_lambada_local"], task_manager=tm,
                                  bootstrap_iters=0, log_samples=False)["results"]["crucible_lambada_local"]
    split = [{"context": " ".join(t.split(" ")[:-1]), "target": " " + t.split(" ")[-1]} for t in texts]
    ours = eval_lambada(random_lm.scorer, split)
    assert ours["acc"] >= 1 / 6
    assert res["acc,none"] == pytest.approx(ours["acc"])
    assert res["perplexity,none"] == pytest.approx(ours["perplexity"], rel=1e-4)

    # by registry name and model_args string, as the lm-eval CLI would build it
    res = lm_eval.simple_evaluate(model="crucible", model_args=f"checkpoint={paths['checkpoint']},"
                                  f"tokenizer={paths['tokenizer']}", tasks=["crucible_wikitext_local"],
                                  task_manager=tm, batch_size=4, bootstrap_iters=0,
                                  log_samples=False)["results"]["crucible_wikitext_local"]
    ours = eval_wikitext(lm.scorer, pages)
    assert res["word_perplexity,none"] == pytest.approx(ours["word_perplexity"], rel=1e-4)
    assert res["byte_perplexity,none"] == pytest.approx(ours["byte_perplexity"], rel=1e-4)
    assert res["bits_per_byte,none"] == pytest.approx(ours["bits_per_byte"], rel=1e-4)
    assert math.isfinite(ours["word_perplexity"]) and ours["word_perplexity"] > ours["token_perplexity"]
