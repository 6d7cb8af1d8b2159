"""Loading a config (YAML + overrides, readable errors), resuming it, and writing it out."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from common.config.data import TASK_DEFAULTS
from common.config.run import RunConfig


class ConfigError(Exception):
    """Invalid configuration; `lines` are "field: problem" strings for the user."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def _format_validation_error(err: ValidationError) -> list[str]:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(e["loc"][-1]), _field_names(e["loc"][:-1]), n=1)
            hint = f"did you mean {'.'.join([*map(str, e['loc'][:-1]), close[0]])}? " if close else "check the spelling; "
            msg = f"unknown field ({hint}`exgrpo config` lists every field)"
        elif e["type"] == "union_tag_not_found":
            msg = f"{loc}.kind is missing: name the backend with its fields (docs/configuration.md lists the kinds)"
        if "\n" in msg:  # several problems from one model validator
            lines.extend(msg.splitlines())
        else:
            lines.append(f"{loc}: {msg}" if loc else msg)
    return lines


def _field_names(loc: tuple) -> list[str]:
    """Field names of the section at `loc` (empty when it is not a plain section, e.g. a union)."""
    model: type[BaseModel] = RunConfig
    for part in loc:
        f = model.model_fields.get(str(part))
        if f is None or not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)):
            return []
        model = f.annotation
    return list(model.model_fields)


def _parse_value(text: str) -> Any:
    """A command-line value is read as YAML (`8`, `0.5`, `true`, `null`, `[a, b]`), else kept as text."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `dotted.key=value` overrides to a raw (unvalidated) config dict."""
    errors = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            errors.append(f"{item}: an override is written key=value, e.g. buffer.group_size=8")
            continue
        node = raw
        parts = key.strip().split(".")
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                errors.append(f"{key}: {p} is a value, not a section")
                break
            node = child
        else:
            node[parts[-1]] = _parse_value(value)
    if errors:
        raise ConfigError(errors)
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (optional), apply overrides, validate. Raises ConfigError with readable lines."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError([f"{p}: is a folder; pass a YAML config file"])
        if not p.is_file():
            raise ConfigError([f"{p}: config file not found"])
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError([f"{p}: not valid YAML ({e})"]) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError([f"{p}: the top level must be a mapping of sections"])
        raw = loaded or {}
    return _validate(apply_overrides(raw, overrides or []))


def _validate(raw: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


RESUMABLE_FIELDS = (
    "total_steps", "total_rollouts",
    "eval",  # held-out evaluation, off the training path
    "checkpoint.every_steps", "checkpoint.keep_last",
    "tracking.enabled", "tracking.log_plots", "tracking.log_model",
    "cluster",  # where and how the run's processes run: address, num_cpus, autoscale, restarts, stall limits...
    "generator.num_generators", "generator.num_cpus", "generator.max_restarts", "generator.stop_timeout_s",
    "generator.retry_backoff_s", "generator.start_timeout_s", "generator.replace_budget",
    "generator.replace_window_s", "generator.idle_sleep_s",
    "reward.num_workers", "reward.timeout_s", "reward.worker_memory_mb", "reward.worker_start_timeout_s",
    "reward.max_error_fraction",
    "buffer.call_timeout_s", "buffer.start_timeout_s", "buffer.lease_timeout_s", "buffer.snapshot_every_s", "buffer.max_restarts",
    "buffer.max_concurrency",
    "learner.publish_timeout_s", "learner.start_timeout_s", "learner.placement", "learner.num_cpus",
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
    checkpoint's buffer was built with 8". An override that repeats the saved value is no change."""
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
    return new, changes


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


def yaml_value(v: Any) -> str:
    """A value as it would be written in an override (`null`, `true`, `8`, `[0.9, 0.999]`)."""
    return yaml.safe_dump(v, default_flow_style=True).removesuffix("\n...\n").strip()


def to_yaml(cfg: BaseModel) -> str:
    """The resolved config as YAML (what `exgrpo config` prints and MLflow stores)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def flatten(cfg: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value, for MLflow parameters."""
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
