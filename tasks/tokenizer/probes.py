"""Real text samples for the tokenizer report's code, mathematics and non-Latin-script rows.

Every sample comes from files under data_root (shared/data, see its README), never from text
written here:

- code: bodies of `.. code-block:: <language>` directives in the Linux kernel RST docs (C, shell,
  DTS, ...; blocks marked none/text/rst/console are diagrams or prose and left out);
- math: bodies of `.. math::` directives and `:math:` roles in the same docs (LaTeX);
- english_prose: lines of a Gutenberg book, the Latin-script baseline;
- one row per script from Debian handbook pages in the constructed docs-crawl WARC, extracted with
  ingest's own HTML extraction and normalisation: cyrillic (ru-RU), greek (el-GR), arabic
  (ar-MA, fa-IR), han (zh-CN, zh-TW), japanese (ja-JP), hangul (ko-KR); only pages where at
  least 30% of the non-space characters are non-ASCII (many handbook pages are untranslated);
  han, japanese and hangul are filled up with the kernel docs' own translations (zh_CN, zh_TW,
  ja_JP, ko_KR) when the handbook shard has too little.

A category whose file is missing or yields nothing is returned with `available: False` and the
reason, and the report says so instead of inventing text.
"""
from __future__ import annotations

import functools
import gzip
import json
import re
import textwrap
from pathlib import Path

from tasks.config import PipelineConfig

SCRIPT_LANGUAGES = {  # handbook language folders (URL .../browse/<lang>/stable/<page>.html) per row
    "cyrillic": ["ru-RU"],
    "greek": ["el-GR"],
    "arabic": ["ar-MA", "fa-IR"],
    "han": ["zh-CN", "zh-TW"],
    "japanese": ["ja-JP"],
    "hangul": ["ko-KR"],
}
# kernel doc translations (Documentation/translations/<locale>/) that fill a script row up when the
# handbook shard has too few translated pages (its ko-KR and el-GR pages are mostly English)
KERNEL_TRANSLATIONS = {"han": ["zh_CN", "zh_TW"], "japanese": ["ja_JP"], "hangul": ["ko_KR"]}
CATEGORIES = ["english_prose", "code", "math", *SCRIPT_LANGUAGES]

# An RST directive body: the indented block after the directive line (options, then content).
_DIRECTIVE = r"^([ \t]*)\.\. {name}::[ \t]*([^\n]*)\n((?:\1[ \t]+[^\n]*\n|[ \t]*\n)+)"
_CODE_BLOCK = re.compile(_DIRECTIVE.format(name="code-block"), re.M)
_MATH_BLOCK = re.compile(_DIRECTIVE.format(name="math"), re.M)
_MATH_ROLE = re.compile(r":math:`([^`]+)`")
_OPTION = re.compile(r"^:[\w-]+:.*$")
NOT_CODE = {"", "none", "text", "rst", "console"}  # code-block languages that are diagrams or prose
MAX_BLOCK_CHARS = 2000  # one long listing must not be the whole code sample
MIN_NON_ASCII = 0.3  # handbook pages below this share of non-ASCII characters are untranslated
_HANDBOOK_LANG = re.compile(r"/browse/([A-Za-z]{2}-[A-Za-z]{2})/")


def _directive_body(block: str) -> str:
    """Dedent a directive body and drop its leading `:option:` lines."""
    lines = textwrap.dedent(block).strip("\n").splitlines()
    while lines and _OPTION.match(lines[0].strip()):
        lines.pop(0)
    return "\n".join(lines).strip("\n")


def _missing(reason: str) -> dict:
    return {"available": False, "reason": reason, "texts": [], "origin": None}


def _capped(texts: list[str], max_chars: int) -> list[str]:
    out, total = [], 0
    for t in texts:
        if not t.strip():
            continue
        if total + len(t) > max_chars:
            if not out:
                out.append(t[:max_chars])
            break
        out.append(t)
        total += len(t)
    return out


def _rst_samples(path: Path, max_chars: int) -> tuple[dict[str, dict], dict[str, list[str]]]:
    """The code and math rows, and the translated docs per locale (for the script rows)."""
    translations: dict[str, list[str]] = {loc: [] for locs in KERNEL_TRANSLATIONS.values() for loc in locs}
    if not path.is_file():
        reason = f"file not found: {path}"
        return {"code": _missing(reason), "math": _missing(reason)}, translations
    code, math = [], []
    code_docs, math_docs = set(), set()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            text, doc_id = doc.get("text") or "", doc.get("id")
            if "translations/" in (doc_id or ""):
                locale = doc_id.split("translations/", 1)[1].split("/", 1)[0]
                if locale in translations and sum(map(len, translations[locale])) < max_chars:
                    translations[locale].append(text)
                continue  # translated copies repeat the English formulas and code
            for m in _CODE_BLOCK.finditer(text):
                body = _directive_body(m.group(3))
                if m.group(2).strip().lower() not in NOT_CODE and sum(map(len, code)) < max_chars:
                    code.append(body[:body.rfind("\n", 0, MAX_BLOCK_CHARS) if len(body) > MAX_BLOCK_CHARS else None])
                    code_docs.add(doc_id)
            for m in _MATH_BLOCK.finditer(text):
                math.append(_directive_body(m.group(3)))
                math_docs.add(doc_id)
            for m in _MATH_ROLE.finditer(text):
                math.append(m.group(1))
                math_docs.add(doc_id)
    out = {}
    for name, texts, docs, what in (("code", code, code_docs, "`.. code-block::` bodies"),
                                    ("math", math, math_docs, "`.. math::` bodies and `:math:` roles (LaTeX)")):
        texts = _capped(texts, max_chars)
        out[name] = ({"available": True, "texts": texts, "docs": len(docs),
                      "origin": f"{what} from {len(docs)} Linux kernel docs ({path.name})"}
                     if texts else _missing(f"no {what} in {path.name}"))
    return out, translations


def _prose_sample(path: Path, max_chars: int) -> dict:
    if not path.is_file():
        return _missing(f"file not found: {path}")
    lines = path.read_text(encoding="utf-8").splitlines()[1:]  # line 0 is the "[ Title ]" header
    paragraphs = ["\n".join(lines[k:k + 10]) for k in range(0, len(lines), 10)]
    texts = _capped(paragraphs, max_chars)
    return {"available": bool(texts), "texts": texts, "docs": 1,
            "origin": f"Gutenberg book {path.name} (NLTK copy, tokenised upstream: spaces around punctuation)",
            **({} if texts else {"reason": f"{path.name} is empty"})}


def _handbook_pages(path: Path, pages_per_language: int) -> dict[str, list[str]]:
    """{handbook language: extracted page texts}, the first translated pages in WARC order."""
    if not path.is_file():
        return {}
    from tasks.config import IngestConfig
    from tasks.ingest.extract import decode_html, extract_html
    from tasks.ingest.normalise import normalise_text
    from tasks.ingest.readers import RawRecord, iter_records

    ingest = IngestConfig()
    wanted = {lang: script for script, langs in SCRIPT_LANGUAGES.items() for lang in langs}
    pages: dict[str, list[str]] = {lang: [] for lang in wanted}
    for rec in iter_records(path, "warc"):
        if not isinstance(rec, RawRecord) or rec.error or rec.kind != "html" or not rec.url:
            continue
        m = _HANDBOOK_LANG.search(rec.url)
        lang = m.group(1) if m and "debian-handbook" in rec.url else None
        if lang not in pages or len(pages[lang]) >= pages_per_language:
            continue
        text, _, _ = extract_html(decode_html(rec.payload or b"", rec.content_type), rec.url,
                                  ingest.favour_precision, with_metadata=False)
        text = normalise_text(text or "", nfc=ingest.normalise_nfc, whitespace=ingest.normalise_whitespace)
        visible = [c for c in text if not c.isspace()]
        non_ascii = sum(ord(c) > 127 for c in visible) / max(len(visible), 1)
        if len(text) >= 200 and non_ascii >= MIN_NON_ASCII:  # skip near-empty and untranslated pages
            pages[lang].append(text)
        if all(len(v) >= pages_per_language for v in pages.values()):
            break
    return pages


def _script_samples(warc: Path, rst: Path, handbook: dict[str, list[str]], translations: dict[str, list[str]],
                    max_chars: int) -> dict[str, dict]:
    out = {}
    for script, langs in SCRIPT_LANGUAGES.items():
        texts = [t for lang in langs for t in _capped(handbook.get(lang, []), max_chars // len(langs))]
        origins = [f"Debian handbook pages { {lang: len(handbook.get(lang, [])) for lang in langs} } "
                   f"from {warc.name} (extracted as ingest does)"] if texts else []
        room = max_chars - sum(map(len, texts))
        locales = KERNEL_TRANSLATIONS.get(script, [])
        if locales and room > max_chars // 4:
            extra = {loc: _capped(translations.get(loc, []), room // len(locales)) for loc in locales}
            if any(extra.values()):
                texts += [t for loc in locales for t in extra[loc]]
                origins.append(f"Linux kernel doc translations { {loc: len(v) for loc, v in extra.items()} } "
                               f"from {rst.name}")
        out[script] = ({"available": True, "texts": texts, "docs": len(texts), "origin": "; ".join(origins)}
                       if texts else _missing(f"no translated pages for {langs} in {warc.name}"
                                              + (f" nor kernel translations {locales}" if locales else "")))
    return out


def load_probe_samples(cfg: PipelineConfig) -> dict[str, dict]:
    """{category: {"available", "texts", "docs", "origin" | "reason"}} for every category
    (read once per process for the same files and limits; treat the result as read-only)."""
    pcfg = cfg.tokenizer.probes
    if not pcfg.enabled:
        return {c: _missing("probes disabled (tokenizer.probes.enabled: false)") for c in CATEGORIES}
    return _load(cfg.resolve_uri(pcfg.prose), cfg.resolve_uri(pcfg.rst), cfg.resolve_uri(pcfg.warc),
                 pcfg.pages_per_language, pcfg.max_chars)


@functools.lru_cache(maxsize=4)
def _load(prose: str, rst: str, warc: str, pages_per_language: int, max_chars: int) -> dict[str, dict]:
    out = {"english_prose": _prose_sample(Path(prose), max_chars)}
    rows, translations = _rst_samples(Path(rst), max_chars)
    out.update(rows)
    handbook = _handbook_pages(Path(warc), pages_per_language)
    out.update(_script_samples(Path(warc), Path(rst), handbook, translations, max_chars))
    return {c: out[c] for c in CATEGORIES}
