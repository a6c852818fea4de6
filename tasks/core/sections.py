"""The config sections a stage reads: named in its `run` signature, and the only ones it can touch.

    def run(self, cfg: Annotated[PipelineConfig, Reads("model", "train")], inputs, ctx) -> TrainResult:

`stage_sections(stage)` reads them from that annotation; `stage_config(stage, cfg)` is the tree the
stage wrapper hands the stage: every other section withheld, so reading one (`cfg.deploy.model_name`,
iterating `cfg.sources`) raises UndeclaredSection, an AttributeError naming the section and the
stage. A withheld section still serialises with its real values: a stage may hand its config on
whole (the torchrun workers' config file, the model card's dump), only Python code may not read it.
The run's identity (name, data_root, run_root, resolve_uri) is no section and is always there.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, get_type_hints

from pydantic import BaseModel

from tasks.config import PipelineConfig

# the run's identity, which every stage has: not a section
ROOT_FIELDS = ("name", "data_root", "run_root")
SECTIONS = tuple(f for f in PipelineConfig.model_fields if f not in ROOT_FIELDS)


class UndeclaredSection(AttributeError):
    """A stage read a config section its `run` signature does not name."""


@dataclass(frozen=True, init=False)
class Reads:
    """`Annotated[PipelineConfig, Reads(...)]`: the sections of the tree a stage's `run` reads."""
    sections: tuple[str, ...]

    def __init__(self, *sections: str):
        unknown = sorted(set(sections) - set(SECTIONS))
        if unknown:
            raise ValueError(f"Reads{sections}: no config sections {unknown}; the sections are {', '.join(SECTIONS)}")
        object.__setattr__(self, "sections", tuple(sections))


def stage_sections(stage: Any) -> tuple[str, ...]:
    """The sections `stage.run`'s `cfg` annotation names (Reads); TypeError if it names none."""
    hint = get_type_hints(type(stage).run, include_extras=True).get("cfg")
    reads = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Reads)]
    if len(reads) != 1:
        raise TypeError(f"{type(stage).__name__}.run must annotate cfg as Annotated[PipelineConfig, Reads(...)]")
    return reads[0].sections


def stage_config(stage: Any, cfg: PipelineConfig) -> PipelineConfig:
    """`cfg` with every section `stage` does not read withheld (a copy; `cfg` is unchanged). The
    stack's sections of a whole-file config (infra.settings.CrucibleConfig) are withheld too."""
    keep = set(stage_sections(stage))
    update = {name: _withheld(getattr(cfg, name), name, stage.name)
              for name in type(cfg).model_fields if name not in ROOT_FIELDS and name not in keep}
    return cfg.model_copy(update=update)


def _refusal(section: str, stage: str) -> UndeclaredSection:
    return UndeclaredSection(f"the {stage} stage read config section {section!r}, which its run signature does "
                             f"not name: add it to the Reads(...) of its cfg annotation")


_WITHHELD_TYPES: dict[tuple[type, str, str], type] = {}


def _withheld_type(cls: type[BaseModel], section: str, stage: str) -> type[BaseModel]:
    """A subclass of the section's model whose fields cannot be read from Python."""
    key = (cls, section, stage)
    if key not in _WITHHELD_TYPES:
        def __getattribute__(self, name: str):
            if name in cls.model_fields:
                raise _refusal(section, stage)
            return super(sub, self).__getattribute__(name)

        def __getattr__(self, name: str):  # what Python calls after __getattribute__ refused
            raise _refusal(section, stage)

        def __reduce__(self):  # a copy sent to another process (Ray) is the plain section
            return _section_copy, (cls, dict(self.__dict__), set(self.__pydantic_fields_set__))

        sub = type(f"Withheld{cls.__name__}", (cls,), {"__getattribute__": __getattribute__,
                                                        "__getattr__": __getattr__, "__reduce__": __reduce__})
        _WITHHELD_TYPES[key] = sub
    return _WITHHELD_TYPES[key]


def _section_copy(cls: type[BaseModel], values: dict, fields_set: set) -> BaseModel:
    return cls.model_construct(_fields_set=fields_set, **values)


class WithheldList(list):
    """A list section (sources) that serialises but cannot be read from Python."""

    def __init__(self, items: list, section: str, stage: str):
        super().__init__(items)
        self._section, self._stage = section, stage

    def _refuse(self, *args, **kwargs):
        raise _refusal(self._section, self._stage)

    __iter__ = __getitem__ = __len__ = __contains__ = __reversed__ = index = count = copy = _refuse

    def __bool__(self) -> bool:
        raise _refusal(self._section, self._stage)

    # copies (copy.copy, model_copy(deep=True)) stay withheld, like the withheld model sections;
    # a pickled copy (a Ray task's) is the plain list, like theirs
    def __copy__(self) -> "WithheldList":
        return WithheldList(list(list.__iter__(self)), self._section, self._stage)

    def __deepcopy__(self, memo: dict) -> "WithheldList":
        return WithheldList(copy.deepcopy(list(list.__iter__(self)), memo), self._section, self._stage)

    def __reduce__(self):
        return list, (list(list.__iter__(self)),)


def _withheld(value: Any, section: str, stage: str) -> Any:
    if isinstance(value, BaseModel):
        sub = _withheld_type(type(value), section, stage)
        return sub.model_construct(_fields_set=set(value.model_fields_set), **value.__dict__)
    if isinstance(value, list):
        return WithheldList(value, section, stage)
    raise TypeError(f"config section {section!r} is a {type(value).__name__}: no way to withhold it")
