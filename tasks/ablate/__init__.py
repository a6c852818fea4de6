"""The curation ablation: the same model and token budget on a langid-only vs a fully curated corpus,
scored on clean held-out text. Public API: `run_ablation(cfg, out_dir, tracking_uri, ...)`."""
from tasks.ablate.run import ablation_markdown, langid_only, run_ablation

__all__ = ["run_ablation", "langid_only", "ablation_markdown"]
