"""Generate docs/configuration.md from the pydantic models (so the docs cannot drift).

    python scripts/gen_config_docs.py > docs/configuration.md
    python scripts/gen_config_docs.py --resume-fields   # docs/reference.md's list of the fields --resume may change
Tests check that the committed files equal this output.
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from pydantic import BaseModel

from common.config import RunConfig


def _type_name(ann) -> str:
    s = str(ann).replace("typing.", "").replace("common.config.", "")
    return s.replace("<class '", "").replace("'>", "")


_OPS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "len ≥"}


def _bounds(metadata: list) -> str:
    parts = []
    for m in metadata:
        for attr, op in _OPS.items():
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{op} {v}")
    return ", ".join(parts)


def _rows(model: type[BaseModel], prefix: str, out: list[str], sections: list[tuple[str, type[BaseModel]]]) -> None:
    for name, f in model.model_fields.items():
        ann = f.annotation
        sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if sub is not None:
            sections.append((prefix + name, sub))
            continue
        args = typing.get_args(ann)
        if typing.get_origin(ann) is dict and isinstance(args[1], type) and issubclass(args[1], BaseModel):
            doc = (f.description or "").replace("|", "\\|").replace("\n", " ")
            out.append(f"| `{prefix}{name}` | `dict[str, {args[1].__name__}]` | `{{}}` |  | {doc} |")
            sections.append((f"{prefix}{name}.<name>", args[1]))
            continue
        variants = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(variants) == 1 and type(None) in args:  # an optional section, off (null) by default
            doc = (f.description or "").replace("|", "\\|").replace("\n", " ")
            out.append(f"| `{prefix}{name}` | `{variants[0].__name__} \\| None` | `null` |  | {doc} |")
            sections.append((f"{prefix}{name}", variants[0]))
            continue
        if variants:
            for v in variants:
                sections.append((f"{prefix}{name} (kind: {v.model_fields['kind'].default})", v))
            continue
        bounds = _bounds(f.metadata)
        default = "required" if f.is_required() else f.get_default(call_default_factory=True)
        default = "null" if default is None else default
        doc = (f.description or "").replace("|", "\\|").replace("\n", " ")
        out.append(f"| `{prefix}{name}` | `{_type_name(ann)}` | `{default}` | {bounds} | {doc} |")


def render() -> str:
    lines = ["# Configuration reference", "",
             "Generated from `common/config/` by `python scripts/gen_config_docs.py`; do not edit by hand.",
             "Set fields in a YAML file or as `dotted.key=value` overrides: "
             "`exgrpo train config.yaml buffer.max_lag=0 learner.optim.lr=1e-5`.",
             "`exgrpo config [...]` prints the resolved configuration.",
             "A section chosen by its kind (`generator.engine`, `learner.weight_sync`, `learner.loss.policy_loss`) "
             "is one of the kinds below; its kind alone names it (`learner.loss.policy_loss=gspo`, with or without "
             "that kind's fields), and a field given without `kind` picks it: the default kind's own fields keep it "
             "(`generator.engine.cpu_vllm_min_params=0` stays auto), a field only one kind has sets that kind "
             "(`learner.weight_sync.relay_fanout=2` sets collective; `max_num_seqs` alone sets vllm).",
             ""]
    queue: list[tuple[str, type[BaseModel]]] = [("", RunConfig)]
    while queue:
        prefix, model = queue.pop(0)
        title = prefix or "(root)"
        lines += [f"## `{title}`", "", (model.__doc__ or "").strip(), "",
                  "| field | type | default | bounds | meaning |", "| --- | --- | --- | --- | --- |"]
        rows: list[str] = []
        subs: list[tuple[str, type[BaseModel]]] = []
        key_prefix = prefix.split(" (kind")[0] + "." if prefix else ""
        _rows(model, key_prefix, rows, subs)
        lines += rows + [""]
        queue.extend(subs)
    return "\n".join(lines)


RESUME_DOC = Path(__file__).resolve().parents[1] / "docs" / "reference.md"
RESUME_START = ("<!-- resume-fields: generated from RESUMABLE_FIELDS (common/config/loading.py) by "
                "`python scripts/gen_config_docs.py --resume-fields`; do not edit -->")
RESUME_END = "<!-- /resume-fields -->"


def resume_fields() -> str:
    """docs/reference.md's list of the fields `--resume` may change, one line per section."""
    from common.config import RESUMABLE_FIELDS

    by_section: dict[str, list[str]] = {}
    for f in RESUMABLE_FIELDS:
        by_section.setdefault(f.split(".")[0] if "." in f else "", []).append(f)
    whole = [f for f in by_section.get("", []) if f in RunConfig.model_fields
             and isinstance(RunConfig.model_fields[f].annotation, type)
             and issubclass(RunConfig.model_fields[f].annotation, BaseModel)]
    lines = ["- " + ", ".join(f"`{f}`" for f in by_section.get("", []) if f not in whole)]
    lines += [f"- everything under `{f}.` ({(RunConfig.model_fields[f].annotation.__doc__ or '').strip()})"
              for f in whole]
    lines += ["- " + ", ".join(f"`{f}`" for f in fields) for section, fields in by_section.items() if section]
    return "\n".join([RESUME_START, *lines, RESUME_END])


def doc_with_resume_fields(text: str) -> str:
    head, _, rest = text.partition(RESUME_START)
    _, _, tail = rest.partition(RESUME_END)
    if not rest:
        raise SystemExit(f"{RESUME_DOC.name} has no {RESUME_START[:30]}... block to fill")
    return head + resume_fields() + tail


if __name__ == "__main__":
    if sys.argv[1:] == ["--resume-fields"]:  # rewrite docs/reference.md's generated block in place
        RESUME_DOC.write_text(doc_with_resume_fields(RESUME_DOC.read_text()))
    else:
        sys.stdout.write(render())
