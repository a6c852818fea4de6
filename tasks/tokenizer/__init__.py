"""Tokenizer stage: byte-level BPE trained on the curated corpus."""
from tasks.tokenizer.bpe import load_tokenizer, special_token_ids, train_tokenizer

__all__ = ["train_tokenizer", "load_tokenizer", "special_token_ids"]
