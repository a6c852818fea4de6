"""Evaluate stage: val loss / perplexity, sample generations and the task suite for one checkpoint.

The suite (WikiText-2, LAMBADA, HellaSwag, calibration) is tasks.evaluate.suite; the
lm-evaluation-harness adapter is tasks.evaluate.lm_eval_adapter.CrucibleLM; the comparison with a
reference model behind an OpenAI-compatible endpoint is tasks.evaluate.reference.
"""
from tasks.evaluate.evaluate import evaluate_checkpoint, val_loss, val_window_starts
from tasks.evaluate.scoring import LMScorer, Scored, rolling_chunks
from tasks.evaluate.suite import expected_calibration_error, run_suite

__all__ = ["evaluate_checkpoint", "val_loss", "val_window_starts", "LMScorer", "Scored", "rolling_chunks",
           "run_suite", "expected_calibration_error"]
