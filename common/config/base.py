"""Base of every config section."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


def pick_kind(value: Any, variants: dict[str, type[BaseModel]], default: str, where: str,
              refused: tuple[str, ...] = ()) -> Any:
    """A union section given its kind alone (`generator.engine=transformers`) is that kind's section. One given
    without `kind` (`generator.engine.max_num_seqs=64`) gets the kind its fields name: the default kind when it has
    them all, else the one kind (not in `refused`, kinds a run never takes) that has them all. Fields of different
    kinds together are refused with the kinds that hold them. Unknown fields leave the default kind, whose
    validation names them (with suggestions)."""
    if isinstance(value, str):
        return {"kind": value}
    if not isinstance(value, (dict, BaseModel)):
        kinds = ", ".join(k for k in variants if k not in refused)
        raise ValueError(f"a kind ({kinds}) or a section of one, not {value!r}: e.g. {where}={default}, or "
                         f"{where}.kind={default} with its fields")
    if not isinstance(value, dict) or not value or "kind" in value:
        return value
    keys = set(value)
    fits = [k for k, m in variants.items() if keys <= set(m.model_fields) and k not in refused]
    if default in fits or len(fits) == 1:
        return {"kind": default if default in fits else fits[0], **value}
    holders = {key: [k for k, m in variants.items() if key in m.model_fields and k not in refused] for key in keys}
    if fits or not all(holders.values()):
        if fits:  # several kinds have them all: the user must say which
            raise ValueError(f"{', '.join(sorted(keys))}: fields of kinds {' and '.join(fits)}; set {where}.kind")
        return {"kind": default, **value}
    owned = "; ".join(f"{key} is a field of kind {' or '.join(ks)}" for key, ks in sorted(holders.items()))
    raise ValueError(f"{owned}: one kind at a time; set {where}.kind to one of them (fields of the other "
                     "kinds do not apply to it)")


def yaml_value(v: Any) -> str:
    """A value as it would be written in an override (`null`, `true`, `8`, `[0.9, 0.999]`)."""
    return yaml.safe_dump(v, default_flow_style=True).removesuffix("\n...\n").strip()
