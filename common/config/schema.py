"""The config as a user types it: dotted paths through sections, union sections (whose `kind` is not part of
the path) and mapping fields (whose keys may hold dots: `generator.node_labels.ray.io/accelerator-type=H100`).

pydantic's error locations name a union member by its tag (`generator.engine.vllm.max_num_seqs`), which the
user cannot type; `place` translates a location into the user's path, and `split_key` cuts an override's key
into the parts `apply_overrides` sets.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from common.config.base import yaml_value


def section_model(ann: Any) -> type[BaseModel] | None:
    """The section a field holds (None: a value, a union or a mapping). An optional section (`LoRAConfig | None`,
    off by default) is its section: `learner.lora.rank=8` turns it on."""
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(members) == 1 and len(typing.get_args(ann)) == 2:
            ann = members[0]
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def union_kinds(field: FieldInfo) -> dict[str, type[BaseModel]] | None:
    """kind -> section of a discriminated union field (None: not one)."""
    if field.discriminator is None:
        return None
    members = [a for a in typing.get_args(field.annotation) if section_model(a)]
    return {m.model_fields["kind"].default: m for m in members}


def mapping_value(ann: Any) -> tuple[bool, type[BaseModel] | None]:
    """(whether the field is a mapping, the section each of its values is; None for plain values)."""
    if typing.get_origin(ann) is not dict:
        return False, None
    return True, section_model(typing.get_args(ann)[1])


@dataclass
class Place:
    """Where a pydantic error location points, in the user's terms."""

    path: list[str]
    """The dotted path the user types (union tags left out)."""
    model: type[BaseModel] | None
    """The section holding the last part (None when the path left the known sections)."""
    field: FieldInfo | None
    """The last part's field when it is a value field (None: unknown name, or a section)."""
    union: tuple[str, str, dict[str, type[BaseModel]]] | None
    """(path of the union section, the kind chosen, every kind) when the path runs through one."""
    rest: tuple
    """Location parts below the value field: the member of a `bool | Literal['auto']` union that failed."""

    @property
    def dotted(self) -> str:
        return ".".join(self.path)


def place(loc: tuple, root: type[BaseModel] | None = None) -> Place:
    """The user's path for a pydantic error location (union tags dropped, mapping keys kept)."""
    if root is None:
        from common.config.run import RunConfig

        root = RunConfig
    model: type[BaseModel] | None = root
    path: list[str] = []
    union = None
    i = 0
    while i < len(loc) and model is not None:
        name = str(loc[i])
        path.append(name)
        i += 1
        f = model.model_fields.get(name)
        if f is None:
            return Place(path, model, None, union, tuple(loc[i:]))
        kinds = union_kinds(f)
        if kinds is not None:
            if i < len(loc) and loc[i] in kinds:
                union = (".".join(path), str(loc[i]), kinds)
                model = kinds[str(loc[i])]
                i += 1
                continue
            return Place(path, model, None, union, tuple(loc[i:]))
        if section_model(f.annotation):
            model = section_model(f.annotation)
            continue
        is_map, value_model = mapping_value(f.annotation)
        if is_map and value_model is not None and i < len(loc):
            path.append(str(loc[i]))
            i += 1
            model = value_model
            continue
        return Place(path, model, f, union, tuple(loc[i:]))
    return Place(path + [str(p) for p in loc[i:]], model, None, union, ())


def split_key(key: str, root: type[BaseModel] | None = None) -> list[str]:
    """An override's dotted key cut into the parts to set: a mapping of values takes the rest of the key as one
    key (`generator.node_labels.ray.io/accelerator-type`), a mapping of sections the parts up to the last field
    as one name (`eval.sets.math.500.path`)."""
    if root is None:
        from common.config.run import RunConfig

        root = RunConfig
    parts = key.split(".")
    out: list[str] = []
    model: type[BaseModel] | None = root
    i = 0
    while i < len(parts):
        name = parts[i]
        out.append(name)
        i += 1
        f = model.model_fields.get(name) if model is not None else None
        if f is None:
            model = None
            continue
        kinds = union_kinds(f)
        if kinds is not None:  # the next part is a field of one of the kinds (auto's `vllm.` section included)
            nxt = parts[i] if i < len(parts) else None
            holder = next((m for m in kinds.values() if nxt in m.model_fields), None)
            model = holder
            continue
        if section_model(f.annotation):
            model = section_model(f.annotation)
            continue
        is_map, value_model = mapping_value(f.annotation)
        if is_map and i < len(parts):
            if value_model is None:
                return out + [".".join(parts[i:])]
            if len(parts) - i >= 2:
                return out + [".".join(parts[i:-1]), parts[-1]]
        model = None
    return out


def leaf_paths(root: type[BaseModel] | None = None) -> list[tuple[str, str | None]]:
    """(path, kind) of every value field a user can set (a union's `kind` included); kind names the union kind
    it needs (None: any)."""
    if root is None:
        from common.config.run import RunConfig

        root = RunConfig
    out: list[tuple[str, str | None]] = []

    def walk(model: type[BaseModel], prefix: str, kind: str | None) -> None:
        for name, f in model.model_fields.items():
            kinds = union_kinds(f)
            if kinds is not None:
                for k, m in kinds.items():
                    walk(m, f"{prefix}{name}.", k)
            elif section_model(f.annotation):
                walk(section_model(f.annotation), f"{prefix}{name}.", kind)
            elif mapping_value(f.annotation)[1] is not None:
                walk(mapping_value(f.annotation)[1], f"{prefix}{name}.<name>.", kind)
            else:
                out.append((prefix + name, kind))

    walk(root, "", None)
    return out


def section_paths(root: type[BaseModel] | None = None) -> list[str]:
    """Every section's path (`buffer`, `model.toy`, `generator.engine`, `eval.sets`, ...)."""
    return sorted({p.rsplit(".", k)[0] for p, _ in leaf_paths(root) for k in range(1, p.count(".") + 1)})


def example_value(field: FieldInfo) -> str | None:
    """A value as the user writes it, for a message: the docstring's `e.g. ...` example, else the default."""
    doc = field.description or ""
    m = re.search(r"e\.g\.\s*`?(\[[^\]]*\]|\{[^}]*\})", doc) or re.search(r"`(\{[^}`]*\})`", doc)
    if m:
        return m.group(1)
    default = field.get_default(call_default_factory=True)
    return None if default is None or default == {} or default == [] else yaml_value(default)


def choices(ann: Any) -> list[str] | None:
    """The values a field of bools, literals and None takes, as written (None: it takes other values too)."""
    out: list[str] = []
    for a in typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,):
        if a is bool:
            out += ["true", "false"]
        elif a is type(None):
            out.append("null")
        elif typing.get_origin(a) is typing.Literal:
            out += [str(v) for v in typing.get_args(a)]
        else:
            return None
    return out
