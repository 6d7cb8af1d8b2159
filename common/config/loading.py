"""Loading a config (YAML + overrides, readable errors), resuming it, and writing it out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from common.config.base import yaml_value
from common.config.data import TASK_DEFAULTS
from common.config.errors import RENAMED, RENAMED_VALUES, format_errors
from common.config.loss import move_flat_surrogate
from common.config.run import RunConfig
from common.config.secrets import PASSWORD_ENV, REDACTED, hidden, redact_value, split_password, with_password
from common.config.schema import mapping_value, place, section_model, split_key, union_kinds
from common.config.yaml_file import YamlFileError, read_yaml


class ConfigError(Exception):
    """Invalid configuration; `lines` are "field: problem" strings for the user."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def _parse_value(text: str) -> Any:
    """A command-line value is read as YAML (`8`, `0.5`, `true`, `null`, `[a, b]`), else kept as text."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `dotted.key=value` overrides to a raw (unvalidated) config dict. A mapping field takes the rest of
    the key as one key (`generator.node_labels.ray.io/accelerator-type=H100`)."""
    errors = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            errors.append(f"{item}: an override is written key=value, e.g. buffer.group_size=8")
            continue
        parts = split_key(key.strip())
        problem = _below_a_value(parts) or _set(raw, parts, _parse_value(value))
        if problem:
            errors.append(f"{key.strip()}: {problem}")
    if errors:
        raise ConfigError(errors)
    return raw


def _names_a_field(key: str) -> bool:
    """`buffer.group_size`, `total_steps`: a dotted key whose first part is a config field (a section's name
    alone, `data`, is no override)."""
    parts = key.split(".")
    f = RunConfig.model_fields.get(parts[0])
    return f is not None and all(p.isidentifier() for p in parts) and (len(parts) > 1 or not section_model(f.annotation))


def colon_override(token: str, following: str | None = None) -> tuple[str, int] | None:
    """`buffer.group_size:8` or `buffer.group_size: 8` (YAML's form on the command line): the override meant,
    `buffer.group_size=8`, and how many tokens it takes (1 or 2); None when `token` is not that form."""
    key, sep, value = token.partition(":")
    if not sep or "=" in token or not _names_a_field(key) or Path(token).exists():
        return None
    if value.strip():
        return f"{key}={value.strip()}", 1
    if following is not None and "=" not in following:
        return f"{key}={following}", 2
    return f"{key}=<value>", 1


def dashed_overrides(argv: list[str]) -> list[str]:
    """`--buffer.group_size=8`, `--total_steps 5`: overrides written as options (argparse would answer
    "unrecognized arguments"); one line per token naming the key=value form."""
    problems = []
    for i, tok in enumerate(argv):
        key, sep, value = tok.removeprefix("--").partition("=")
        if not tok.startswith("--") or not _names_a_field(key):
            continue
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        value = value if sep else (nxt if nxt is not None and not nxt.startswith("-") and "=" not in nxt else "<value>")
        problems.append(f"{tok}: overrides are written key=value, without dashes: did you mean {key}={value}?")
    return problems


def _below_a_value(parts: list[str]) -> str | None:
    """`buffer.group_size.x`: group_size is a value, so nothing is below it."""
    pl = place(tuple(parts))
    if pl.field is not None and pl.rest and not mapping_value(pl.field.annotation)[0]:
        return f"{pl.path[-1]} is a value, not a section"
    return None


def _takes_a_kind(parts: list[str]) -> bool:
    """Whether `parts` is a section chosen by its kind (a discriminated union: `generator.engine`,
    `learner.weight_sync`, `learner.loss.policy_loss`), which takes its kind alone as a value."""
    holder = place(tuple(parts[:-1])).model
    f = holder.model_fields.get(parts[-1]) if holder is not None else None
    return f is not None and union_kinds(f) is not None


def _set(raw: dict[str, Any], parts: list[str], value: Any) -> str | None:
    """Set `value` at `parts` in `raw`, making sections on the way; the problem when a part is a value. A section
    chosen by its kind, given its kind alone (`generator.engine=transformers`) and its fields, in either order,
    keeps both."""
    node = raw
    for i, p in enumerate(parts[:-1]):
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        elif isinstance(child, str) and _takes_a_kind(parts[: i + 1]):
            child = node[p] = {"kind": child}
        if not isinstance(child, dict):
            return f"{p} is a value, not a section"
        node = child
    if isinstance(value, str) and isinstance(node.get(parts[-1]), dict) and _takes_a_kind(parts):
        node[parts[-1]]["kind"] = value
    else:
        node[parts[-1]] = value
    return None


def _expand_dotted(node: dict[str, Any], model: type[BaseModel] = RunConfig) -> dict[str, Any]:
    """A YAML config's dotted keys (`learner.optim.lr: 1e-5`, the form experiment specs use) set the nested field,
    as on the command line; the keys of mapping fields (`node_labels: {ray.io/x: y}`) are left as they are."""
    for key in [k for k in node if isinstance(k, str) and "." in k and k.split(".")[0] in model.model_fields]:
        value = node.pop(key)
        problem = _set(node, split_key(key, model), value)
        if problem:
            raise ConfigError([f"{key}: {problem}"])
    for key, value in node.items():
        f = model.model_fields.get(key) if isinstance(key, str) else None
        if f is None or not isinstance(value, dict):
            continue
        sub = section_model(f.annotation) or (union_kinds(f) or {}).get(value.get("kind"))
        if sub is not None:
            _expand_dotted(value, sub)
    return node


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (optional), apply overrides, validate. Raises ConfigError with readable lines."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _expand_dotted(read_config_file(Path(path)))
    return _validate(apply_overrides(raw, overrides or []))


def load_saved_config(path: str | Path) -> tuple[RunConfig, list[str]]:
    """A run folder's own config.yaml, written by an earlier release perhaps: its renamed keys and values
    (`learner.lr`, `buffer.fresh_draw: official`) are moved to their new names, one "old -> new" line each, since
    the user did not type them. ConfigError as `load_config` for the rest."""
    raw = _expand_dotted(read_config_file(Path(path)))
    moved = _rename_saved(raw)
    return _validate(raw), moved


def _rename_saved(raw: dict[str, Any]) -> list[str]:
    """Move `raw`'s old keys to their new names in place (a new key already there wins); the moves, in words."""
    moved = []
    for old, new in RENAMED.items():
        *parents, leaf = old.split(".")
        node = raw
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        value = node.pop(leaf)
        *new_parents, new_leaf = new.split(".")
        target = raw
        for p in new_parents:
            target = target.setdefault(p, {})
        target.setdefault(new_leaf, value)
        moved.append(f"{old} -> {new}")
    for (key, old_value), new_value in RENAMED_VALUES.items():
        section, leaf = key.split(".")
        node = raw.get(section)
        if isinstance(node, dict) and node.get(leaf) == old_value:
            node[leaf] = new_value
            moved.append(f"{key}={old_value} -> {new_value}")
    loss = raw.get("learner", {}).get("loss") if isinstance(raw.get("learner"), dict) else None
    if isinstance(loss, dict):
        moved += move_flat_surrogate(loss)
    return moved


DATA_SUFFIXES = (".jsonl", ".ndjson", ".parquet", ".csv", ".tsv", ".arrow", ".gz", ".zst", ".bz2", ".xz", ".zip")
"""Files that are data, not a config (`exgrpo config train.jsonl`)."""


def read_config_file(p: Path) -> dict[str, Any]:
    """A YAML config file's mapping. ConfigError for a folder, a missing file, a data or binary file (named as
    such: it goes in data.train_path), invalid YAML or a key given twice (with the file and line: read_yaml) and
    a top level that is not a mapping of sections."""
    if p.is_dir():
        raise ConfigError([f"{p}: is a folder; pass a YAML config file"])
    if not p.is_file():
        raise ConfigError([f"{p}: config file not found"])
    with p.open("rb") as f:
        head = f.read(4096)
    kind = ("Parquet" if head.startswith(b"PAR1") else "compressed" if head.startswith((b"\x1f\x8b", b"PK\x03\x04",
            b"(\xb5/\xfd", b"BZh", b"\xfd7zXZ")) else None)
    if kind or p.name.lower().endswith(DATA_SUFFIXES):
        raise ConfigError([f"{p}: this looks like a {kind + ' ' if kind else ''}data file, not a config; {_data_hint(p, kind)}"])
    try:
        loaded = read_yaml(p, "a config is a YAML file of sections (`exgrpo config > run.yaml` writes one)")
    except YamlFileError as e:
        text = p.read_bytes().decode("utf-8", errors="replace")
        if text.lstrip().startswith("{") and len(text.strip().splitlines()) > 1 and "given twice" not in str(e):
            raise ConfigError([f"{p}: this looks like a JSONL data file, not a config; {_data_hint(p, 'jsonl')}"]) from None
        raise ConfigError([str(e)]) from None
    if isinstance(loaded, list) and loaded and all(isinstance(r, dict) for r in loaded):
        raise ConfigError([f"{p}: this looks like a data file (a list of rows), not a config; {_data_hint(p, 'rows')}"])
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError([f"{p}: the top level must be a mapping of sections"])
    loaded = loaded or {}
    if loaded and not {str(k).split(".")[0] for k in loaded} & set(RunConfig.model_fields):
        if {"question", "answer", "prompt", "problem", "solution"} & set(map(str, loaded)):
            raise ConfigError([f"{p}: this looks like a data file (a row with {', '.join(map(str, loaded))}), not a "
                               f"config; {_data_hint(p, 'rows')}"])
    return loaded


DATA_FORMATS = (".jsonl", ".ndjson", ".json", ".parquet", ".pq")
"""The suffixes `common.data.read_rows` reads (.json as JSON Lines: one row per line)."""


def _data_hint(p: Path, form: str | None = None) -> str:
    """How to use a data file given as the config, in a form `common.data.read_rows` then reads. `form`: "rows"
    (YAML or JSON rows: converted by a one-line command), "jsonl" (JSON Lines content), None (by its name and kind)."""
    import shlex
    import sys

    out, q = p.with_suffix(".jsonl"), lambda x: shlex.quote(str(x))
    if form == "rows":
        code = ("import json, sys, yaml; r = yaml.safe_load(open(sys.argv[1])); "
                "[print(json.dumps(x)) for x in (r if isinstance(r, list) else [r])]")
        return (f"data files are JSON Lines (one row per line) or Parquet: convert it with {q(sys.executable)} "
                f"-c '{code}' {q(p)} > {q(out)} and pass data.train_path={out}")
    suffix = p.suffix.lower()
    if suffix in DATA_FORMATS or suffix in (".gz", ".zst", ".bz2", ".xz", ".zip") or form == "Parquet":
        return f"pass it as data.train_path={p} (or data.test_path), and a YAML file as the config"
    if form == "jsonl":  # JSON Lines under another name (`rows.yaml`)
        return f"data files are named .jsonl or .parquet: rename it (mv {q(p)} {q(out)}) and pass data.train_path={out}"
    return (f"data files are JSON Lines or Parquet: convert it (pandas: pd.read_csv({str(p)!r}).to_json({str(out)!r}, "
            f"orient='records', lines=True)) and pass data.train_path={out}")


def _validate(raw: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_errors(e)) from None


RESUMABLE_FIELDS = (
    "total_steps", "total_rollouts",
    "eval",  # held-out evaluation, off the training path
    "checkpoint.every_steps", "checkpoint.keep_last", "checkpoint.on_full_disk",
    "tracking.enabled", "tracking.log_plots", "tracking.log_model",
    "cluster",  # where and how the run's processes run: address, num_cpus, autoscale, restarts, stall limits...
    "generator.num_generators", "generator.num_cpus", "generator.max_restarts", "generator.stop_timeout_s",
    "generator.retry_backoff_s", "generator.start_timeout_s", "generator.replace_budget",
    "generator.replace_window_s", "generator.idle_sleep_s",
    "reward.num_workers", "reward.timeout_s", "reward.worker_memory_mb", "reward.worker_start_timeout_s",
    "reward.max_error_fraction", "reward.stop_after_error_steps",
    "buffer.call_timeout_s", "buffer.start_timeout_s", "buffer.lease_timeout_s", "buffer.snapshot_every_s", "buffer.max_restarts",
    "buffer.max_concurrency",
    "learner.publish_timeout_s", "learner.start_timeout_s", "learner.placement", "learner.num_cpus",
    "learner.lora.base_dtype",  # how the frozen base is held: a resume converts it exactly
)
"""Fields (a name, or a section and everything under it) that `exgrpo train --resume RUN key=value` may
change: how long the run goes on, how often it checkpoints, where it logs, and the resources and time-outs
of its processes. Every other field shaped the checkpoint (model, optimizer, buffer contents, questions,
sampling, scoring) and is refused, by name, on resume."""

_WHY_FIXED = {
    "buffer": "the checkpoint's buffer was built with {old}",
    "learner": "the checkpoint's learner (weights and optimizer state) was built with {old}",
    "model": "the checkpoint's weights come from {old}",
    "data": "the run's questions (their ids are in the checkpoint's buffer) were loaded with {old}",
    "reward": "the run's experience was scored with {old}",
    "generator": "the run's rollouts were sampled with {old}",
}


def resume_config(saved: RunConfig, overrides: list[str]) -> tuple[RunConfig, dict[str, tuple[Any, Any]]]:
    """A run's saved config with resume overrides applied: `(config, {field: (old, new)})`.

    Raises ConfigError for a misspelt or invalid override (the usual lines), and one line per override
    that changes a field outside RESUMABLE_FIELDS, e.g. "buffer.group_size cannot change on resume: the
    checkpoint's buffer was built with 8". An override that repeats the saved value is no change, nor one that
    gives a redacted URI its secret again; a secret still redacted is refused (`restore_secrets`)."""
    # Defaults left out, so that switching a backend (generator.engine.kind=...) does not meet the old one's fields.
    new = _validate(apply_overrides(_pin_task_defaults(_given_values(saved), saved),
                                    overrides))
    old_flat, new_flat = flatten(saved), flatten(new)
    changes = {k: (old_flat.get(k), new_flat.get(k)) for k in {**old_flat, **new_flat}
               if old_flat.get(k) != new_flat.get(k)}
    fixed = [k for k in sorted(changes) if not any(k == f or k.startswith(f + ".") for f in RESUMABLE_FIELDS)]
    refused = []
    for key in [o.partition("=")[0].strip() for o in overrides] + fixed:
        section = key.removesuffix(".kind")  # a backend switch changes every field of that backend
        covered = [k for k in fixed if k == key or k.startswith(section + ".")]
        if not covered:
            continue
        fixed = [k for k in fixed if k not in covered]
        old = old_flat.get(key, "its saved values")
        why = _WHY_FIXED.get(key.split(".")[0], "the run was started with {old}").format(old=yaml_value(old))
        refused.append(f"{key} cannot change on resume: {why}; start a new run (name=<new name>) to change it")
    if refused:
        raise ConfigError(refused + ["fields that may change on resume: " + ", ".join(
            f + ".*" if f in ("cluster", "eval") else f for f in RESUMABLE_FIELDS)])
    return restore_secrets(new), changes


def _given_values(cfg: BaseModel) -> dict[str, Any]:
    """The values that differ from the defaults, as nested plain data, with the `kind` of every union section
    kept (`generator.engine: {vllm: {max_model_len: 1048}}` alone would not say which engine it is)."""
    full = cfg.model_dump(mode="json")
    sparse = cfg.model_dump(mode="json", exclude_defaults=True)

    def keep_kinds(node: dict, ref: dict) -> dict:
        for k, v in node.items():
            if isinstance(v, dict) and isinstance(ref.get(k), dict):
                keep_kinds(v, ref[k])
                if "kind" in ref[k] and "kind" not in v:
                    v["kind"] = ref[k]["kind"]
        return node

    return keep_kinds(sparse, full)


def _pin_task_defaults(raw: dict[str, Any], saved: RunConfig) -> dict[str, Any]:
    """`raw` with the saved values of the task's TASK_DEFAULTS fields written out, so that one the run set
    back to the field's own default (left out of `raw`) is not filled with the task's on resume."""
    keys = TASK_DEFAULTS.get(saved.data.task, {}) if saved.data.train_path is None else {}
    saved_flat = flatten(saved)
    for key in keys:
        *sections, name = key.split(".")
        node = raw
        for part in sections:
            node = node.setdefault(part, {})
        node[name] = saved_flat[key]
    return raw


def to_yaml(cfg: BaseModel) -> str:
    """The resolved config as YAML (what `exgrpo config` prints, config.yaml holds and MLflow stores), every URI's
    credentials redacted (`common.config.secrets`)."""
    return yaml.safe_dump(_redacted(cfg.model_dump(mode="json")), sort_keys=False)


def _redacted(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _redacted(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_redacted(v) for v in node]
    return redact_value(node)


def flatten(cfg: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value, for MLflow parameters and the changes a resume prints; credentials redacted."""
    return {k: _redacted(v) for k, v in _leaves(cfg, prefix).items()}


def _leaves(cfg: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value as the config holds it (credentials included: for this process only)."""
    out: dict[str, Any] = {}
    for k, v in cfg.model_dump(mode="json").items():
        _flatten_into(out, f"{prefix}{k}", v)
    return out


def _flatten_into(out: dict[str, Any], key: str, v: Any) -> None:
    if isinstance(v, dict):
        for k2, v2 in v.items():
            _flatten_into(out, f"{key}.{k2}", v2)
    else:
        out[key] = v


def restore_secrets(cfg: RunConfig) -> RunConfig:
    """`cfg` as read from a run's config.yaml (or given a redacted URI by `exgrpo experiment`), with tracking.uri's
    redacted password (`user:***@`) read from MLFLOW_TRACKING_PASSWORD. ConfigError, one line per field whose
    secret is still `***`, saying how to supply it."""
    import os

    uri = cfg.tracking.uri
    if hidden(uri) and split_password(uri)[2] == REDACTED and os.environ.get(PASSWORD_ENV):
        cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(
            update={"uri": with_password(uri, os.environ[PASSWORD_ENV])})})
    lines = []
    for key, value in _leaves(cfg).items():
        if hidden(value):
            how = (f"set {PASSWORD_ENV}=<the password>, or pass {key}=<the URI with it>" if key == "tracking.uri"
                   and split_password(value)[2] == REDACTED else f"pass {key}=<the URI with it>")
            lines.append(f"{key}: {value}: its secret was redacted (*** is all the run folder keeps); {how}")
    if lines:
        raise ConfigError(lines)
    return cfg
