import subprocess
import sys
from pathlib import Path

import pytest

from tasks.config import ConfigError, PipelineConfig, load_config

REPO = Path(__file__).resolve().parent.parent


def test_tiny_and_large_configs_validate():
    tiny = load_config(REPO / "configs" / "tiny.yaml")
    assert tiny.name == "tiny" and tiny.train.nproc_per_node == 2
    large = load_config(REPO / "configs" / "large.yaml")
    assert large.ray.address.startswith("ray://") and large.train.nnodes > 1
    assert large.resolve_uri(large.sources[0].uri).startswith("s3://")


def test_h100_config_validates():
    """configs/h100.yaml (docs/gpu.md): bf16 + FSDP2 + compile, a global batch one GPU can split."""
    from tasks.train.data import global_batch

    h100 = load_config(REPO / "configs" / "h100.yaml")
    t = h100.train
    assert (t.device, t.backend, t.parallelism, t.dtype, t.compile) == ("cuda", "nccl", "fsdp2", "bf16", True)
    assert t.peak_flops_per_s == h100.plan.gpus["h100"].peak_bf16_flops
    assert global_batch(t, h100.model.seq_len, t.nproc_per_node) == (256, 64)
    assert global_batch(t, h100.model.seq_len, 8) == (256, 8)  # the same batch on a full node


def test_override_is_parsed_as_yaml_and_applied():
    cfg = load_config(REPO / "configs" / "tiny.yaml", ["train.max_steps=7", "curate.langid.languages={en: 0.5}"])
    assert cfg.train.max_steps == 7
    assert cfg.curate.langid.languages == {"en": 0.5}


@pytest.mark.parametrize("override,path", [
    ("train.max_steps=-1", "train.max_steps"),
    ("model.d_model=130", "model"),
    ("sources.0.format=pdf", "sources.0.format"),
    ("train.no_such_field=1", "train.no_such_field"),
])
def test_bad_values_name_the_field(override, path, tmp_path):
    if override.startswith("sources"):
        bad = tmp_path / "bad.yaml"
        bad.write_text("name: x\nsources:\n  - {name: a, uri: u, format: pdf, licence: l, provenance: p}\n")
        with pytest.raises(ConfigError) as e:
            load_config(bad)
    else:
        with pytest.raises(ConfigError) as e:
            load_config(REPO / "configs" / "tiny.yaml", [override])
    assert path in str(e.value)


def test_duplicate_source_names_rejected():
    src = {"name": "a", "uri": "u", "format": "jsonl", "licence": "l", "provenance": "p"}
    with pytest.raises(Exception, match="duplicate source names"):
        PipelineConfig.model_validate({"name": "x", "sources": [src, src]})


def test_data_root_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("CRUCIBLE_DATA_ROOT", str(tmp_path))
    cfg = load_config(REPO / "configs" / "tiny.yaml")
    assert cfg.resolve_uri("web/x.warc.gz") == str(tmp_path / "web" / "x.warc.gz")


def test_bad_value_exits_2_from_the_flow_entry_point():
    proc = subprocess.run([sys.executable, "-m", "flows.pretrain", str(REPO / "configs" / "tiny.yaml"),
                           "--set", "train.max_steps=-1"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert "train.max_steps" in proc.stderr
