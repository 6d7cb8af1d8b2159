"""pydantic's validation errors as "field: problem" lines in the user's terms.

Every line starts with a path the user can type (a union's kind is not part of it), says what to write
instead, and never shows pydantic's internal type names (`bool`, `literal['auto']`, "valid tuple"):
- an unknown key gets the close names of its section, the kind of a union that has it, or the section
  elsewhere that has a field of that name (`buffer.lr` -> `learner.optim.lr`);
- a value given to a section (`tracking=false`) shows the section's fields and the form to write;
- a mapping, a list or a choice shows an example or the values it takes.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from common.config.base import yaml_value
from common.config.learner import LEARNER_SECTIONS
from common.config.loss import FLAT_SURROGATE_KEYS, flat_surrogate_hint
from common.config.schema import (Place, choices, example_value, leaf_paths, mapping_value, place, section_model,
                                  section_paths)

LISTS = "`exgrpo config` lists every field"

RENAMED = {"learner.official_world_size": "learner.loss.loss_world_size",
           **{f"learner.{name}": f"learner.{section}.{name}" for name, section in LEARNER_SECTIONS.items()}}
"""Keys renamed since a release: an old name is refused with its new one (never accepted silently). The learner's
flat fields moved into its sections (`learner.lr` -> `learner.optim.lr`)."""
RENAMED_VALUES = {("buffer.fresh_draw", "official"): "per_step", ("buffer.trajectory_score", "official"): "chunk_window",
                  ("buffer.trajectory_selector", "lowest_recorded"): "lowest_stored_entropy"}
"""Choices renamed since a release, by key and old value."""


def format_errors(err: ValidationError) -> list[str]:
    """One or more lines per problem; the members of a `bool | Literal['auto']` union share one line."""
    lines: list[str] = []
    done: set[str] = set()
    for e in err.errors():
        pl = place(e["loc"])
        if pl.field is not None and pl.rest and choices(pl.field.annotation):  # a member of a value union failed
            if pl.dotted not in done:
                done.add(pl.dotted)
                lines.append(f"{pl.dotted}: {_not_a_choice(e['input'], pl.field)}")
            continue
        if pl.field is not None and pl.rest:  # an item of a list or a mapping
            lines.append(_item_problem(e, pl))
            continue
        msg = _message(e, pl)
        if "\n" in msg:  # several problems from one model validator, each with its own path
            lines.extend(msg.splitlines())
        else:
            lines.append(f"{pl.dotted}: {msg}" if pl.path else msg)
    return lines


def _message(e: dict, pl: Place) -> str:
    kind, value = e["type"], e.get("input")
    if kind == "extra_forbidden":
        moved = RENAMED.get(pl.dotted, pl.dotted)
        if moved.startswith("learner.loss.") and moved.removeprefix("learner.loss.") in FLAT_SURROGATE_KEYS:
            return flat_surrogate_hint(moved.removeprefix("learner.loss."))
        if pl.dotted in RENAMED:
            return f"renamed: set {RENAMED[pl.dotted]} instead (same meaning)"
        return f"unknown field ({_suggest(pl)})"
    if kind == "union_tag_not_found":
        return "kind is missing: name the backend with its fields (docs/configuration.md lists the kinds)"
    if kind == "union_tag_invalid":
        tags = e["ctx"]["expected_tags"].replace("'", "")
        return f"kind {e['ctx']['tag']!r} is not one of {tags}"
    if kind == "model_type" and pl.model is not None:
        return _section_given_a_value(pl, value)
    if kind == "dict_type" and pl.field is not None:
        return _mapping_form(pl, value)
    if kind in ("list_type", "tuple_type", "too_short", "too_long") and pl.field is not None \
            and _list_shape(pl.field.annotation):
        return f"{_list_shape(pl.field.annotation)}, not {_shown(value)}: e.g. {pl.dotted}={_list_example(pl.field)}"
    if kind in ("literal_error", "bool_parsing", "bool_type") and pl.field is not None \
            and choices(pl.field.annotation):
        if isinstance(value, str) and (pl.dotted, value) in RENAMED_VALUES:
            return f"{value!r} was renamed: set {pl.dotted}={RENAMED_VALUES[pl.dotted, value]} (same meaning)"
        return _not_a_choice(value, pl.field)
    if kind == "string_type" and isinstance(value, bool):
        return _yaml_boolean(pl.dotted, value)
    msg = e["msg"].removeprefix("Value error, ")
    if kind != "value_error" and msg.startswith("Input should") and not isinstance(value, (dict, list)):
        return f"{msg} (given {_shown(value)})"  # `learner.optim.lr=fast`: the value as the user wrote it
    return msg


def _yaml_boolean(dotted: str, value: bool) -> str:
    """`name: on`: YAML reads an unquoted yes/no/on/off/true/false as a boolean; a text field needs it quoted."""
    words = "on, yes or true" if value else "off, no or false"
    word = "on" if value else "off"
    return (f"text expected, but YAML read the value as the boolean {yaml_value(value)} (an unquoted {words} is one); "
            f"quote it to keep it as text, e.g. {dotted}: '{word}' in a YAML file, {dotted}=\"'{word}'\" on the "
            "command line")


def _item_problem(e: dict, pl: Place) -> str:
    """`learner.optim.betas=[x, 0.9]`: which item, what is wrong with it, and the form of the whole value."""
    msg = e["msg"].removeprefix("Value error, ")
    if mapping_value(pl.field.annotation)[0]:
        quote = " (quote a number or true/false to make it text: '1')" if e["type"] == "string_type" else ""
        return f"{pl.dotted}.{pl.rest[0]}: {msg}{quote}"
    item = pl.rest[0] + 1 if isinstance(pl.rest[0], int) else pl.rest[0]
    what = "is missing" if e["type"] == "missing" else f"{_shown(e.get('input'))}: {msg}"
    shape = _list_shape(pl.field.annotation) or "a list"
    return f"{pl.dotted}: item {item} {what} ({shape}, e.g. {pl.dotted}={_list_example(pl.field)})"


def _shown(value: Any) -> str:
    """A value as the user wrote it: text quoted, the rest as YAML (`false`, `3`, `[1, 2]`)."""
    import yaml

    try:
        return repr(value) if isinstance(value, str) else yaml_value(value)
    except yaml.YAMLError:  # an object YAML cannot write (a section given from Python): its repr
        return repr(value)


_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
            "yes": "true", "no": "false", "on": "true", "off": "false", "none": "null"}
"""Short names people write for a choice (`model.dtype=bf16`)."""


def _not_a_choice(value: Any, field: FieldInfo) -> str:
    options = choices(field.annotation) or []
    if not options:
        return f"{_shown(value)} is not valid"
    text = str(value).strip().lower()
    meant = _ALIASES.get(text) if _ALIASES.get(text) in options else None
    meant = meant or next(iter(difflib.get_close_matches(text, options, n=1, cutoff=0.6)), None)
    hint = f"; did you mean {meant}?" if meant and meant != str(value) else ""
    return f"{_shown(value)} is not one of {', '.join(options)}{hint}"


# ----------------------------------------------------------------------------------------- unknown keys


def _near(name: str, candidates: list[str], cutoff: float = 0.6) -> list[str]:
    """Names the user probably meant: fields that `name` is the start or end of (`path` -> `train_path`,
    `test_path`), close spellings, or the field `name`'s initials spell (`learning_rate` -> `lr`)."""
    affix = [c for c in candidates if c.endswith("_" + name) or c.startswith(name + "_")]
    if affix:
        return affix
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=cutoff)
    if close:
        return close
    words = name.split("_")
    initials = "".join(w[:1] for w in words) if len(words) > 1 else None
    return [c for c in candidates if c == initials or ("_" in c and "".join(w[:1] for w in c.split("_")) == name)]


def _or(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _suggest(pl: Place) -> str:
    """What an unknown key probably is: a field of its section, of another kind of its union, or of another
    section."""
    name, section = pl.path[-1], ".".join(pl.path[:-1])
    prefix = section + "." if section else ""
    own = [n for n in (pl.model.model_fields if pl.model is not None else ()) if n != "kind"]
    inner = _inner_fields(pl.model)
    exact = [p for p in _elsewhere(name, prefix) if p.rsplit(".", 1)[-1] == name]
    affix = [n for n in own if n.endswith("_" + name) or n.startswith(name + "_")]  # `data.path`: train_path
    if exact and section and not affix:  # `buffer.max_new_tokens`: generator's field of that name, not max_bytes
        return f"{name} is not in {section}: {_or(exact)}; {LISTS}"
    near = _near(name, own)
    if pl.union is not None and pl.union[0] == section:
        upath, kind, kinds = pl.union
        for other, model in kinds.items():
            hit = _near(name, [n for n in model.model_fields if n != "kind"]) if other != kind else []
            if hit and (not near or hit[0] == name):  # a field of another kind, unless a near name of this one
                inner = [f"{upath}.{n}.{hit[0]}" for n, f in pl.model.model_fields.items()
                         if section_model(f.annotation) is model]  # auto's own vllm settings
                keep = f", or {inner[0]} to keep kind {kind}" if inner else ""
                holders = [k for k, m in kinds.items() if k not in (kind, "synthetic") and hit[0] in m.model_fields
                           ] or [other]  # the synthetic engine is simulation only: never suggested to a run
                return (f"{hit[0]} is a field of kind {' or '.join(holders)}, not of {kind}: set {upath}.kind="
                        f"{other} to use {upath}.{hit[0]}{keep}")
    if near:
        return f"did you mean {_or([prefix + n for n in near])}? {LISTS}"
    near = _near(name, list(inner)) if section else []  # `learner.learning_rate`: learner.optim.lr
    if near:
        return f"did you mean {_or([prefix + inner[n] for n in near])}? {LISTS}"
    elsewhere = _elsewhere(name, prefix)
    if elsewhere:
        where = f"not in {section}" if section else "in a section"
        return f"{name} is {where}: {_or(elsewhere)}; {LISTS}"
    return f"check the spelling; {LISTS}"


def _inner_fields(model: type[BaseModel] | None) -> dict[str, str]:
    """The fields of `model`'s own sections, by name: `lr` -> `optim.lr` in `learner`."""
    out: dict[str, str] = {}
    for sub, f in (model.model_fields.items() if model is not None else ()):
        inner = section_model(f.annotation)
        for n in (inner.model_fields if inner is not None else ()):
            out.setdefault(n, f"{sub}.{n}")
    return out


def _elsewhere(name: str, prefix: str) -> list[str]:
    """Paths of other sections that end in `name` (or in a name close to it), shallowest first, at most 3."""
    paths = sorted({p for p, _ in leaf_paths()} | set(section_paths()), key=lambda p: (p.count("."), p))
    paths = [p for p in paths if not p.startswith(prefix) or not prefix]
    exact = [p for p in paths if p.rsplit(".", 1)[-1] == name and p != prefix + name]
    if exact:
        return exact[:3]
    by_last: dict[str, list[str]] = {}
    for p in paths:
        by_last.setdefault(p.rsplit(".", 1)[-1], []).append(p)
    near = _near(name, list(by_last), cutoff=0.8)
    return [p for n in near for p in by_last[n]][:3]


# ------------------------------------------------------------------------------ sections, mappings, lists


def _section_given_a_value(pl: Place, value: Any) -> str:
    """`tracking=false`, `eval.sets.aime=aime.jsonl`: the section's fields, and the field the value fits."""
    fields = {n: f for n, f in pl.model.model_fields.items() if n != "kind"}
    if isinstance(value, bool) and _off_by_default(pl):  # `learner.lora=true`: not rank=true
        first = next(iter(fields))
        example = example_value(fields[first]) or yaml_value(fields[first].get_default(call_default_factory=True))
        return (f"a section that is off by default (null), not {_shown(value)}: "
                + (f"setting any of its fields turns it on, e.g. {pl.dotted}.{first}={example} (its fields: "
                   f"{', '.join(fields)})" if value else f"{pl.dotted}=null turns it off"))
    fits = [n for n, f in fields.items() if _accepts(f.annotation, value)]
    names = list(fields)
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    written = f"{pl.dotted}.<field>={yaml_value(value) if fits else '<value>'}"
    sure = len(fits) == 1 or fits and fits[0] == names[0]  # the only taker, or the section's first field
    example = f", e.g. {pl.dotted}.{fits[0]}={yaml_value(value)}" if sure else ""  # `learner=1e-5`: no num_cpus
    return (f"a section, not a value ({_shown(value)}): a section needs a key, written {written}{example} (its "
            f"fields: {shown})")


def _off_by_default(pl: Place) -> bool:
    """Whether the section at `pl` is an optional one whose default is None (`learner.lora`)."""
    from common.config.run import RunConfig

    model: type[BaseModel] | None = RunConfig
    for part in pl.path[:-1]:
        f = model.model_fields.get(part) if model is not None else None
        model = section_model(f.annotation) if f is not None else None
    f = model.model_fields.get(pl.path[-1]) if model is not None else None
    return f is not None and f.default is None and not f.is_required()


def _accepts(ann: Any, value: Any) -> bool:
    if value is None or isinstance(ann, type) and issubclass(ann, BaseModel):
        return False
    try:
        TypeAdapter(ann).validate_python(value)
    except (ValidationError, TypeError, ValueError):
        return False
    return True


def _mapping_form(pl: Place, value: Any) -> str:
    """`generator.node_labels=H100`: a mapping is written key by key, or whole."""
    _, value_model = mapping_value(pl.field.annotation)
    if value_model is not None:
        first = next(n for n in value_model.model_fields if n != "kind")
        return (f"named sections, not {_shown(value)}: write {pl.dotted}.<name>.{first}=..., e.g. "
                f"{pl.dotted}.aime.{first}=aime.jsonl")
    example = example_value(pl.field) or "{key: value}"
    import yaml

    try:
        key, val = next(iter(yaml.safe_load(example).items()))
    except (yaml.YAMLError, AttributeError, StopIteration):
        key, val = "key", "value"
    return (f"a mapping, not {_shown(value)}: write {pl.dotted}.<key>=<value>, e.g. {pl.dotted}.{key}={val} "
            f"(or the whole mapping: {pl.dotted}='{example}')")


def _list_shape(ann: Any) -> str | None:
    """'a list of 2 numbers' for tuple[float, float], 'a list' for list[str] (None: not a list field)."""
    args = [a for a in typing.get_args(ann) if a is not type(None)] if typing.get_origin(ann) is not None else []
    if typing.get_origin(ann) in (typing.Union, types.UnionType) and len(args) == 1:
        ann = args[0]
    origin = typing.get_origin(ann)
    if origin is tuple:
        items = typing.get_args(ann)
        what = "numbers" if all(a in (int, float) for a in items) else "values"
        return f"a list of {len(items)} {what}, written [a, b]"
    if origin is list:
        return "a list, written [a, b]"
    return None


def _list_example(field: FieldInfo) -> str:
    return example_value(field) or "[a, b]"
