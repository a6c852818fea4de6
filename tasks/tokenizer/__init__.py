"""Tokenizer stage: byte-level BPE trained on the curated corpus, validated by a report."""
from tasks.tokenizer.bpe import TokenizerValidationError, load_tokenizer, special_token_ids, train_tokenizer

__all__ = ["train_tokenizer", "load_tokenizer", "special_token_ids", "TokenizerValidationError"]
