"""Shared building blocks: the document schema, steps with uniform stats, hashing, the run context."""
