"""Tokens stage: the corpus as flat little-endian token files plus index.json."""
from tasks.tokens.binfile import dtype_for_vocab, load_index, open_doc_starts, open_split
from tasks.tokens.prepare import is_val_doc, prepare_tokens

__all__ = ["prepare_tokens", "load_index", "open_split", "dtype_for_vocab", "is_val_doc", "open_doc_starts"]
