"""Model-based quality: a fastText reference-vs-crawl classifier and CCNet-style KenLM perplexity.

Both train from config (`quality.classifier`, `quality.kenlm`), score documents as Filter steps
with uniform StepStats (`QualityClassifierFilter`, `KenLMFilter`), and run Ray-parallel over
Parquet shards with the model loaded once per worker (`tasks.quality.score.score_shards`).
"""
from tasks.quality.text import ccnet_normalize, iter_corpus, lm_tokens

__all__ = ["ccnet_normalize", "iter_corpus", "lm_tokens"]
