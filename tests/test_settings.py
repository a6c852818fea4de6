"""One YAML file, two owners: the stage layer's sections (tasks/config.py) and the stack's (infra/settings.py:
ports, state, databases, the Ray cluster, the lineage service)."""
from __future__ import annotations

from pathlib import Path

import pytest

import tasks.config
from infra.settings import CrucibleConfig, load_config
from tasks.config import INFRA_SECTIONS, ConfigError, PipelineConfig

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def test_the_stack_sections_are_infras_and_still_in_the_one_file():
    cfg = load_config(TINY, ["stack.prefect_port=4300", "stack.database=postgres", "lineage.service_port=5999"])
    assert isinstance(cfg, CrucibleConfig) and cfg.stack.prefect_port == 4300 and cfg.lineage.service_port == 5999
    assert cfg.stack.database == "postgres" and cfg.train.max_steps > 0  # the stages' sections beside them
    for name in ("StackConfig", "LineageConfig"):
        assert not hasattr(tasks.config, name)  # the stage layer does not define them
    stages = PipelineConfig.model_validate(cfg.model_dump())  # the stage layer's view leaves them out
    assert not any(hasattr(stages, s) for s in INFRA_SECTIONS) and stages.train == cfg.train
    assert CrucibleConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # and the whole file round-trips


@pytest.mark.parametrize("override, field", [("stack.prefect_port=0", "stack.prefect_port"),
                                             ("stack.ray_workerz=3", "stack.ray_workerz"),
                                             ("lineage.http_url=ftp://x", "lineage.http_url"),
                                             ("train.max_steps=0", "train.max_steps")])
def test_a_bad_value_in_either_part_names_its_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(TINY, [override])
