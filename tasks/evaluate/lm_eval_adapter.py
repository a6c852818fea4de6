"""lm-evaluation-harness adapter: run lm-eval tasks against a Crucible checkpoint.

    from tasks.evaluate.lm_eval_adapter import CrucibleLM   # registers the model "crucible"
    import lm_eval
    lm_eval.simple_evaluate(model="crucible",
                            model_args="checkpoint=runs/x/train/checkpoints/step-000200,tokenizer=.../tokenizer.json",
                            tasks=["lambada_openai"])

or from the command line (lm-eval's own CLI, with the model registered first):

    python -m tasks.evaluate.lm_eval_adapter run --model crucible \\
        --model_args checkpoint=DIR,tokenizer=tokenizer.json --tasks lambada_openai

`CrucibleLM` implements lm-eval's three request types with lm-eval's semantics (lm_eval.api.model.LM):

loglikelihood(requests)          each request's .args = (context, continuation) -> [(logprob, is_greedy)]
                                 (empty context: conditioned on EOS; trailing context spaces move
                                 to the continuation; inputs longer than seq_len are left-truncated)
loglikelihood_rolling(requests)  .args = (text,) -> [logprob of the whole text after EOS], in
                                 disjoint windows of seq_len where the last window gets full
                                 context (`stride` < seq_len: overlapping windows, more context)
generate_until(requests)         .args = (context, {"until": [...], "max_gen_toks": n, ...}) ->
                                 [continuation cut before the first stop string]; greedy unless
                                 do_sample with temperature > 0 (seeded by `seed`)

Scoring is tasks.evaluate.scoring.LMScorer, the same code as the built-in task suite. When
`lm_eval` is importable the class subclasses lm_eval.api.model.LM and is registered as "crucible";
otherwise it is a plain class with the same methods, taking any objects with `.args` or plain
argument tuples as requests.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from tasks.evaluate.scoring import LMScorer

log = logging.getLogger(__name__)

try:  # optional dependency: the adapter works without it
    from lm_eval.api.model import LM as _Base
    from lm_eval.api.registry import register_model as _register_model

    HAVE_LM_EVAL = True
except ImportError:
    _Base = object
    _register_model = None
    HAVE_LM_EVAL = False

MODEL_NAME = "crucible"


def _args(request) -> tuple:
    args = getattr(request, "args", request)
    return args if isinstance(args, tuple) else tuple(args) if isinstance(args, list) else (args,)


class CrucibleLM(_Base):
    """A Crucible checkpoint as an lm-evaluation-harness model (see the module doc)."""

    def __init__(self, checkpoint: str | Path | None = None, tokenizer: str | Path | None = None,
                 batch_size: int | str | None = 16, max_gen_toks: int = 256, stride: int | None = None,
                 threads: int | None = None, seed: int = 0, scorer: LMScorer | None = None, **kwargs):
        if HAVE_LM_EVAL:
            super().__init__()
        if scorer is None:
            if checkpoint is None or tokenizer is None:
                raise ValueError("CrucibleLM needs checkpoint= and tokenizer= (or a scorer)")
            scorer = LMScorer.from_files(checkpoint, tokenizer)
        self.scorer = scorer
        if batch_size not in (None, "auto") and not str(batch_size).startswith("auto"):
            scorer.batch_size = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.stride = None if stride is None else int(stride)
        self.seed = int(seed)
        if threads:
            torch.set_num_threads(int(threads))
        ignored = {k: v for k, v in kwargs.items() if v is not None and k not in ("max_batch_size", "device")}
        if kwargs.get("device") not in (None, "cpu"):
            ignored["device"] = kwargs["device"]
        if ignored:
            log.warning("CrucibleLM ignores %s (CPU model)", sorted(ignored))

    # lm-eval reads these on some paths
    @property
    def eot_token_id(self) -> int:
        return self.scorer.eos_id

    @property
    def max_length(self) -> int:
        return self.scorer.seq_len

    @property
    def tokenizer_name(self) -> str:
        return "crucible-bpe"

    def _cache(self, kind: str, args: tuple, result) -> None:
        hook = getattr(self, "cache_hook", None)
        if hook is not None:
            hook.add_partial(kind, args, result)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [_args(r) for r in requests]
        for a in pairs:
            if len(a) != 2:
                raise ValueError(f"loglikelihood request args must be (context, continuation), got {a!r}")
        scored = self.scorer.loglikelihood([(str(c), str(x)) for c, x in pairs])
        out = [(s.logprob, s.is_greedy) for s in scored]
        for a, res in zip(pairs, out):
            self._cache("loglikelihood", a, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [_args(r)[0] for r in requests]
        out = [s.logprob for s in self.scorer.loglikelihood_rolling([str(t) for t in texts], self.stride)]
        for t, res in zip(texts, out):
            self._cache("loglikelihood_rolling", (t,), res)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for r in requests:
            a = _args(r)
            context, kwargs = a[0], dict(a[1]) if len(a) > 1 and a[1] else {}
            until = kwargs.pop("until", None)
            until = [until] if isinstance(until, str) else list(until or [])
            max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            seed = kwargs.pop("seed", None)
            if not do_sample:
                temperature = 0.0
            gen = torch.Generator().manual_seed(self.seed if seed is None else int(seed)) if temperature > 0 else None
            text = self.scorer.generate_until(str(context), until, max_gen, temperature, gen)
            out.append(text)
            self._cache("generate_until", a, text)
        return out


if HAVE_LM_EVAL:
    try:
        _register_model(MODEL_NAME)(CrucibleLM)
    except ValueError:  # already registered by another import of this module (e.g. as __main__)
        pass


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the "crucible" model registered."""
    if not HAVE_LM_EVAL:
        print("lm-eval is not installed (pip install 'lm-eval==0.4.13')", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
