"""`exgrpo experiment SPEC.yaml`: named variants x seeds at an equal generated-rollout budget.

    exgrpo experiment ablations                     # the bundled spec (cluster/experiments/ablations.yaml)
    exgrpo experiment my_spec.yaml --jobs 2         # two runs at a time (e.g. on a cluster)
    exgrpo experiment ablations --variants exgrpo plain_replay   # only these variants of the spec

Every (variant, seed) is one `exgrpo train` subprocess that stops at the rollout budget, nested as an MLflow
child of one parent run; runs start seed by seed, the variants in an order shuffled by the seed (`run_order`). A
finished run folder is reused when its overrides and the product code that made it (`code_version`) are today's
(`--rerun` starts over). The report (the spec's primary contrast with its 95% interval, every other paired
difference Holm-adjusted, tables, a plot: cluster/experiment_results.py) is logged to the parent run; the exit
code is non-zero when a run failed. Details: docs/reference.md (Comparing variants fairly),
docs/internals.md#clusterexperimentpy"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from cluster.experiment_presets import PRESETS
from cluster.experiment_results import RunResult, collect, plot, table
from cluster.experiment_stop import Stopping

BUNDLED = Path(__file__).resolve().parent / "experiments"
STOP = Stopping()  # SIGTERM / Ctrl-C: forwarded to the runs in flight, and no new run starts
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class ExperimentSpec(BaseModel):
    """What `exgrpo experiment` runs. Overrides are dotted keys -> values, as on the command line."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str
    """Experiment name: the parent MLflow run and the prefix of every run folder."""
    budget_rollouts: int = Field(ge=1)
    """Generated rollouts each run trains on before it stops (the equal budget)."""
    seeds: list[int] = Field(min_length=1)
    """Seeds of every variant (buffer, learner and generator seeds are set from it)."""
    base: dict[str, Any] = {}
    """Overrides for every run (e.g. eval.every_steps, total_steps as a safety cap)."""
    variants: dict[str, dict[str, Any]] = Field(min_length=1)
    """Variant name -> its overrides ({} = the defaults); `preset: NAME` takes a named set of overrides first
    (`PRESETS`: exgrpo_paper, grpo_paper)."""
    run_timeout_s: float = Field(6 * 3600, gt=0)
    """A run still going after this long is killed and reported as failed (its own stall limits come first)."""
    reference: str | None = None
    """The variant every other is compared with (paired differences by seed, with 95% intervals); None: the first."""
    compare: list[tuple[str, str]] = []
    """More paired differences to print, [a, b] for a − b: the pairs that isolate one rule (e.g. [exgrpo,
    gaussian_only]), beside those with the reference. Holm-adjusted with every other difference but the primary."""
    primary: tuple[str, str] | None = Field(None, validate_default=True)
    """The one contrast the experiment is for, [a, b] for a − b, declared before it runs (required with two or more
    variants): printed first with its plain 95% interval; every other interval is Holm-adjusted."""

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"{v!r}: use letters, digits, '.', '_' and '-' (it names run folders)")
        return v

    @field_validator("seeds")
    @classmethod
    def _each_seed_once(cls, v: list[int]) -> list[int]:
        twice = sorted({s for s in v if v.count(s) > 1})
        if twice:
            raise ValueError(f"{v}: each seed once (a variant's runs are named by their seed, so seed "
                             f"{', '.join(map(str, twice))} would be one run twice); e.g. seeds: "
                             f"{sorted(set(v) | set(range(len(v))))[:len(v)]}")
        return v

    @field_validator("variants")
    @classmethod
    def _safe_variants(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        bad = [k for k in v if not _NAME.match(k)]
        if bad:
            raise ValueError(f"variant names {bad}: use letters, digits, '.', '_' and '-'")
        unknown = [f"{k}: preset: {o['preset']!r}" for k, o in v.items() if "preset" in o and o["preset"] not in PRESETS]
        if unknown:
            raise ValueError(f"{'; '.join(unknown)}: not a preset (presets: {', '.join(PRESETS)})")
        return v

    @field_validator("reference")
    @classmethod
    def _reference_is_a_variant(cls, v: str | None, info: ValidationInfo) -> str | None:
        variants = info.data.get("variants") or {}
        if v is not None and variants and v not in variants:
            raise ValueError(f"{v!r} is not a variant (variants: {', '.join(variants)})")
        return v

    @field_validator("primary")
    @classmethod
    def _primary_variants(cls, v: tuple[str, str] | None, info: ValidationInfo) -> tuple[str, str] | None:
        variants = info.data.get("variants") or {}
        if v is None:
            if len(variants) >= 2:
                raise ValueError(f"name the one contrast the experiment is for, before it runs: primary: [a, b] for "
                                 f"a − b (e.g. primary: [{', '.join(list(variants)[:2])}]); it gets the plain 95% "
                                 "interval, every other difference a Holm-adjusted one")
            return v
        unknown = [n for n in v if variants and n not in variants]
        if unknown:
            raise ValueError(f"{', '.join(map(repr, unknown))}: not a variant (variants: {', '.join(variants)})")
        if v[0] == v[1]:
            raise ValueError(f"[{v[0]}, {v[0]}]: a variant against itself; name two variants")
        return v

    @field_validator("compare")
    @classmethod
    def _compare_variants(cls, v: list[tuple[str, str]], info: ValidationInfo) -> list[tuple[str, str]]:
        variants = info.data.get("variants") or {}
        unknown = sorted({n for pair in v for n in pair if variants and n not in variants})
        if unknown:
            raise ValueError(f"{', '.join(map(repr, unknown))}: not a variant (variants: {', '.join(variants)})")
        same = [a for a, b in v if a == b]
        if same:
            raise ValueError(f"[{same[0]}, {same[0]}]: a variant against itself; name two variants")
        return v


# ------------------------------------------------------------------------------------------ loading


class SpecError(ValueError):
    """A spec that cannot run; `lines` say what to change."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def load_spec(path_or_name: str) -> ExperimentSpec:
    """A spec file, or the name of a bundled spec; every run's config is validated before anything runs."""
    p = Path(path_or_name)
    if not p.is_file() and (BUNDLED / f"{path_or_name}.yaml").is_file():
        p = BUNDLED / f"{path_or_name}.yaml"
    if not p.is_file():
        bundled = sorted(x.stem for x in BUNDLED.glob("*.yaml"))
        raise SpecError([f"{path_or_name}: no such spec file (bundled specs: {', '.join(bundled)})"])
    from common.config.yaml_file import YamlFileError, read_yaml

    try:
        raw = read_yaml(p, "an experiment spec is a YAML file (cluster/experiments/ablations.yaml is one)")
        spec = ExperimentSpec.model_validate(raw)
    except YamlFileError as e:
        raise SpecError([str(e)]) from None
    except ValidationError as e:
        raise SpecError(_spec_problems(p, raw, e)) from None
    owned = _experiment_keys(spec)
    if owned:
        raise SpecError(owned)
    _check_variants(spec)
    return spec


SET_BY_EXPERIMENT = {
    "name": "each run is named <spec name>-<variant>-s<seed>: set the spec's `name`",
    "seed": "set from the spec's `seeds` list, with buffer.seed, learner.seed, generator.seed and data.seed",
    "total_rollouts": "every run's budget: set the spec's `budget_rollouts`",
    "checkpoint.runs_root": "the runs go under `exgrpo experiment --runs-root DIR`",
    "tracking.parent_run_id": "every run is nested under the experiment's own parent run",
    "tracking.log_plots": "off in every run: the experiment draws its own plot",
} | dict.fromkeys(("buffer.seed", "learner.seed", "generator.seed", "data.seed"),
                  "set from the spec's `seeds` list, with seed")
"""Keys `train_command` sets in every run (after the spec's overrides, so a spec's own value would be dropped)."""


def _experiment_keys(spec: ExperimentSpec) -> list[str]:
    """One line per override in `base` or a variant that sets a key the experiment sets itself."""
    def dotted(values: dict[str, Any], prefix: str = "") -> list[str]:
        keys = []
        for k, v in values.items():
            keys.append(prefix + str(k))
            if isinstance(v, dict):  # `checkpoint: {runs_root: x}` reaches the same key
                keys += dotted(v, f"{prefix}{k}.")
        return keys

    where = [("base", spec.base)] + [(f"variants.{v}", o) for v, o in spec.variants.items()]
    lines = [f"{w}: {k}: set by the experiment ({SET_BY_EXPERIMENT[k]})"
             for w, values in where for k in dotted(values) if k in SET_BY_EXPERIMENT]
    for w, values in where:
        for k in dotted(values):
            if k in ("tracking.uri", "tracking.enabled") and w != "base":
                lines.append(f"{w}: {k}: every run of an experiment logs to one MLflow store, which the experiment "
                             "reads its results from: set tracking.uri in the spec's base")
    if _base_tracking(spec, "enabled") is False:
        lines.append("base: tracking.enabled: false: an experiment reads every run's results back from MLflow; "
                     "leave tracking on (tracking.uri in the base picks the store)")
    return lines


def _base_tracking(spec: ExperimentSpec, field: str) -> Any:
    """`tracking.<field>` as the spec's base sets it (dotted or nested), else None."""
    nested = spec.base.get("tracking")
    return spec.base.get(f"tracking.{field}", nested.get(field) if isinstance(nested, dict) else None)


def _spec_problems(p: Path, raw: Any, err: ValidationError) -> list[str]:
    """pydantic's errors in the spec's terms: an empty file, an unknown key with the field it probably is, a
    missing field with what it holds."""
    import difflib

    fields = ExperimentSpec.model_fields
    form = (f"a spec is a mapping of {', '.join(fields)} ({', '.join(n for n, f in fields.items() if f.is_required())}"
            " required; cluster/experiments/ablations.yaml is one)")
    if not isinstance(raw, dict):
        return [f"{p}: {'empty' if raw is None else 'not a mapping'}; {form}"]
    lines = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "spec"
        if e["type"] == "extra_forbidden" and len(e["loc"]) == 1:
            close = difflib.get_close_matches(str(e["loc"][0]), list(fields), n=1, cutoff=0.6)
            lines.append(f"{where}: unknown field" + (f"; did you mean {close[0]}?" if close else f"; {form}"))
        elif e["type"] == "missing" and len(e["loc"]) == 1:
            lines.append(f"{where}: missing: {' '.join((fields[where].description or 'required').split())}")
        elif e["type"] == "string_type" and isinstance(e["input"], bool):
            lines.append(f"{where}: YAML read this as the boolean {str(e['input']).lower()} (unquoted on, off, yes, "
                         "no, true and false are booleans); quote it, e.g. name: 'on'")
        else:
            lines.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
    return lines


def overrides(values: dict[str, Any]) -> list[str]:
    """{dotted key: value} -> ["key=value", ...] as the command line takes them (YAML scalars)."""
    out = []
    for k, v in values.items():
        text = yaml.safe_dump(v, default_flow_style=True).strip()
        out.append(f"{k}={text.removesuffix('...').strip()}")
    return out


def variant_overrides(spec: ExperimentSpec, variant: str) -> list[str]:
    """The overrides of one variant's runs, in the order they apply (a later one wins): the spec's `base`, the
    variant's `preset` (`PRESETS`), then the variant's own."""
    own = dict(spec.variants[variant])
    preset = PRESETS[own.pop("preset")] if "preset" in own else {}
    return overrides(spec.base) + overrides(preset) + overrides(own)


def _check_variants(spec: ExperimentSpec) -> None:
    from common.config import ConfigError, load_config

    problems = []
    for variant in spec.variants:
        try:
            load_config(None, variant_overrides(spec, variant) + [f"total_rollouts={spec.budget_rollouts}"])
        except ConfigError as e:
            problems += [f"variants.{variant}: {line}" for line in e.lines]
    if problems:
        raise SpecError(problems)


def check_inputs(spec: ExperimentSpec) -> None:
    """The start checks of `exgrpo train` for every variant, as `exgrpo config` runs them (the model folder, the
    data, the reward, the cluster address; the built-in model only when cached), before any run starts: a variant
    that names a missing model folder or a reward that does not import is refused here, not at its own run's start
    hours later. Variants that share what the checks read (model, data, reward, generator, cluster, LoRA) are
    checked once. SpecError with every variant's problems."""
    from cluster.preflight import BadInput, check_start
    from common.config import load_config

    problems, seen = [], {}
    for variant in spec.variants:
        cfg = load_config(None, variant_overrides(spec, variant) + [f"total_rollouts={spec.budget_rollouts}"])
        key = json.dumps([getattr(cfg, k).model_dump(mode="json") for k in ("model", "data", "reward", "generator",
                                                                            "cluster")]
                         + [cfg.learner.lora and cfg.learner.lora.model_dump(mode="json")])
        if key not in seen:
            try:
                check_start(cfg, new_run=False, build_model=False)
                seen[key] = []
            except BadInput as e:
                seen[key] = e.lines or [e.heading]
        problems += [f"variants.{variant}: {line}" for line in seen[key]]
    if problems:
        raise SpecError(problems)


# ------------------------------------------------------------------------------------------ running


SEED_KEYS = ("seed", "buffer.seed", "learner.seed", "generator.seed", "data.seed")
"""Set to the run's seed: with data.seed the built-in task's questions (and its built-in model) vary with the seed
too, so the seeds sample the data as well as the run; the runs of one seed still share them (paired)."""

PRODUCT = ("actors", "buffer", "cluster", "common", "learner")
"""The packages whose code makes a run; a run records their version (`code_version`). The experiment's own report
modules (cluster/experiment*.py) only read runs back and are left out."""
_ROOT = Path(__file__).resolve().parents[1]


def code_version(root: Path = _ROOT) -> dict[str, Any]:
    """The product code a run is made by: a hash of its source files (`PRODUCT`'s *.py but cluster/experiment*.py,
    by path and content), and, in a git checkout, the commit and whether those files differ from it (`dirty`). Two
    runs are made by the same code when their `source` hashes agree."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    files = sorted(p for pkg in PRODUCT for p in (root / pkg).rglob("*.py")
                   if not (p.parent.name == "cluster" and p.name.startswith("experiment")))
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    out: dict[str, Any] = {"source": h.hexdigest(), "commit": None, "dirty": None}
    try:
        git = ["git", "-C", str(root)]
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if commit.returncode == 0:
            status = subprocess.run([*git, "status", "--porcelain", "--", *PRODUCT], capture_output=True, text=True,
                                    timeout=30)
            out.update(commit=commit.stdout.strip(), dirty=bool(status.stdout.strip()))
    except (OSError, subprocess.TimeoutExpired):  # no git: the source hash alone
        pass
    return out


def code_changed(then: dict | None, now: dict) -> str | None:
    """Why a finished run made by `then` cannot be reused with the code `now`, in words; None when it can."""
    def named(v: dict) -> str:
        if not v.get("commit"):
            return f"source {v['source'][:12]}"
        return f"commit {v['commit'][:12]}{' with uncommitted changes' if v.get('dirty') else ''}"

    if not then or "source" not in then:
        return "it records no product code version (made before the record, or a changing checkout)"
    if then["source"] != now["source"]:
        return f"made by other product code ({named(then)}, now {named(now)})"
    return None


def run_order(spec: ExperimentSpec) -> list[tuple[str, int]]:
    """(variant, seed) in the order the runs start: seed by seed, the variants shuffled within each seed by a
    generator seeded with it (the same order every time), so the load of the machine over the hours an experiment
    runs is not one variant's."""
    import random

    order = []
    for seed in spec.seeds:
        variants = list(spec.variants)
        random.Random(seed).shuffle(variants)
        order += [(v, seed) for v in variants]
    return order


def run_name(spec: ExperimentSpec, variant: str, seed: int) -> str:
    return f"{spec.name}-{variant}-s{seed}"


def train_command(spec: ExperimentSpec, variant: str, seed: int, runs_root: Path, parent: str | None) -> list[str]:
    seeds = [f"{k}={seed}" for k in SEED_KEYS]
    extra = [f"name={run_name(spec, variant, seed)}", f"checkpoint.runs_root={runs_root}",
             f"total_rollouts={spec.budget_rollouts}", "tracking.log_plots=false"]
    if parent:
        extra.append(f"tracking.parent_run_id={parent}")
    return [sys.executable, "-m", "cluster.cli", "train",
            *variant_overrides(spec, variant), *seeds, *extra]


def password_to_env(cmd: list[str]) -> tuple[list[str], dict[str, str]]:
    """`cmd` with the tracking URI's password redacted, and the environment that hands it to the run instead
    (MLFLOW_TRACKING_PASSWORD, which `exgrpo train` reads back): a command line is visible to every user of the
    machine, and a run writes what it was given."""
    import os

    from common.config.secrets import PASSWORD_ENV, redact, split_password

    env, out = dict(os.environ), []
    for arg in cmd:
        key, sep, value = arg.partition("=")
        password = split_password(value)[2] if sep and key.split(".")[0] == "tracking" else None
        if password is not None:
            env[PASSWORD_ENV], arg = password, redact(arg)
        out.append(arg)
    return out, env


@dataclass(frozen=True)
class Launch:
    """Where and how an experiment starts its runs: their folders under `runs_root`, their logs under `out`/logs,
    nested under the parent MLflow run `parent`; `rerun`: a finished run starts over instead of being reused."""

    runs_root: Path
    out: Path
    parent: str | None
    rerun: bool = False
    store: str = ""  # the MLflow store the runs log to and their results are read from (credentials in the env)


def run_one(spec: ExperimentSpec, variant: str, seed: int, launch: Launch) -> RunResult:
    from common.config.secrets import redact

    runs_root, out, parent, rerun = launch.runs_root, launch.out, launch.parent, launch.rerun

    name = run_name(spec, variant, seed)
    if STOP.signal is not None:  # stopped while earlier runs went on: this one is not started, its folder untouched
        return RunResult(variant, seed, name, ok=False, error=f"not started: stopped by {STOP.signal}")
    folder = runs_root / name
    state = _state(folder)
    settings = [redact(a) for a in train_command(spec, variant, seed, runs_root, None)[4:]]  # the parent's id aside
    changed = settings_changed(state.get("settings"), settings)
    code = code_version()
    other_code = code_changed(state.get("code_version"), code)
    if state.get("status") == "FINISHED" and not rerun and not changed and not other_code:
        print(f"[experiment] {name}: finished earlier, reusing it", file=sys.stderr, flush=True)
        return collect(launch.store, variant, seed, name, state.get("mlflow_run_id"),
                       wall_s=float(state.get("wall_s", float("nan"))))
    if state.get("status") == "FINISHED" and not rerun and (changed or other_code):
        why = f"other settings ({changed})" if changed else other_code
        print(f"[experiment] {name}: finished earlier, not reused: {why}; running it again",
              file=sys.stderr, flush=True)
    if folder.exists():  # an unfinished or --rerun attempt starts over: its run's own files go, nothing else
        from cluster.runtime import RunDir

        left = RunDir(folder).remove_own() if (folder / "state.json").is_file() else sorted(
            p.name for p in folder.iterdir())
        if left:
            return RunResult(variant, seed, name, ok=False, wall_s=0.0,
                             error=f"{folder} holds files no run of this experiment wrote ({', '.join(left[:3])}); "
                                   "move them, or give --runs-root another folder")
    log_path = out / "logs" / f"{name}.log"
    print(f"[experiment] {name}: starting (log {log_path})", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    cmd, env = password_to_env(train_command(spec, variant, seed, runs_root, parent))
    with open(log_path, "w") as log:
        try:
            rc = STOP.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout_s=spec.run_timeout_s)
        except subprocess.TimeoutExpired:
            return RunResult(variant, seed, name, ok=False, wall_s=time.monotonic() - t0,
                             error=f"killed after run_timeout_s={spec.run_timeout_s:.0f}s (see {log_path})")
    wall = time.monotonic() - t0
    if rc is None or STOP.signal is not None:
        return RunResult(variant, seed, name, ok=False, wall_s=wall, error=f"stopped by {STOP.signal}" + (
            "" if rc is None else f", with a checkpoint (see {log_path})"))
    if rc != 0:
        tail = log_path.read_text()[-600:].strip().splitlines()
        return RunResult(variant, seed, name, ok=False, wall_s=wall,
                         error=f"exit {rc}: {tail[-1] if tail else 'no output'} (see {log_path})")
    after = code_version()  # product code edited while it ran: recorded as no version, never reused
    _update_state(folder, wall_s=wall, settings=settings, code_version=code if after == code else None)
    print(f"[experiment] {name}: done in {wall:.0f}s", file=sys.stderr, flush=True)
    return collect(launch.store, variant, seed, name, _state(folder).get("mlflow_run_id"), wall_s=wall)


def settings_changed(then: list[str] | None, now: list[str]) -> str | None:
    """How a finished run's overrides differ from what the spec asks now, in words; None when they are the same or
    the run predates their record (reused as before)."""
    if then is None or then == now:
        return None
    added, dropped = [a for a in now if a not in then], [a for a in then if a not in now]
    return "; ".join(p for p in (f"now {', '.join(added)}" if added else "",
                                 f"then {', '.join(dropped)}" if dropped else "") if p) or "their order changed"


def _state(folder: Path) -> dict:
    try:
        return json.loads((folder / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def _update_state(folder: Path, **kv: Any) -> None:
    s = _state(folder)
    if s:
        s.update(kv)
        (folder / "state.json").write_text(json.dumps(s, indent=2))


# --------------------------------------------------------------------------------------------- main


def select_variants(spec: ExperimentSpec, names: list[str] | None) -> ExperimentSpec:
    """`spec` with only the variants `names` (in the spec's order; None: all of them). SpecError naming the spec's
    variants for a name it does not have."""
    if not names:
        return spec
    unknown = [n for n in names if n not in spec.variants]
    if unknown:
        raise SpecError([f"--variants: {', '.join(unknown)}: not a variant of {spec.name} (its variants: "
                         f"{', '.join(spec.variants)})"])
    return spec.model_copy(update={"variants": {k: v for k, v in spec.variants.items() if k in names}})


def select_seeds(spec: ExperimentSpec, seeds: list[int] | None) -> ExperimentSpec:
    """`spec` with `seeds` in place of its own (None: its own). More seeds narrow the paired intervals; the runs of
    seeds already finished are reused. SpecError for a seed given twice."""
    if not seeds:
        return spec
    try:
        return spec.model_copy(update={"seeds": ExperimentSpec._each_seed_once(list(seeds))})
    except ValueError as e:
        raise SpecError([f"--seeds: {e}"]) from None


def runs_root_problem(root: Path) -> str | None:
    """Why `--runs-root` cannot hold the experiment's folders (a file on the way, a folder refusing a new one), as
    `exgrpo train` refuses such a checkpoint.runs_root; None when it can."""
    import os
    import tempfile

    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir():
        return f"--runs-root: {existing} is a file, not a folder; point --runs-root at a folder"
    try:  # a folder made and removed: what the experiment will do (permission bits do not tell for root)
        os.rmdir(tempfile.mkdtemp(prefix=".exgrpo-check-", dir=existing))
    except OSError as e:
        return (f"--runs-root: cannot create {root}: {existing} refuses a new folder ({e.strerror}); point "
                "--runs-root at a writable folder")
    return None


RESULT_FILES = ("results.md", "results.json", "accuracy_vs_rollouts.png")
"""What an experiment writes into its folder `<runs root>/<spec name>` beside `logs/<run name>.log`."""


def results_folder_problem(out: Path) -> str | None:
    """Why the experiment's folder `out` is not its own: it holds entries an experiment does not write (a user's
    folder of the same name). None when it does not exist, is empty or holds only what an experiment wrote."""
    if not out.exists():
        return None
    if not out.is_dir():
        return (f"{out} is a file; the experiment's results go into a folder of that name: move it, or give "
                "--runs-root another folder")
    logs = out / "logs"
    foreign = [p.name for p in sorted(out.iterdir()) if p.name not in (*RESULT_FILES, "logs")]
    if logs.is_dir():
        foreign += [f"logs/{p.name}" for p in sorted(logs.iterdir()) if not (p.suffix == ".log" and p.is_file())]
    elif logs.exists():
        foreign.append("logs")
    if not foreign:
        return None
    return (f"{out} holds files no experiment wrote ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
            "the experiment writes its results and logs there: move them, or give --runs-root another folder")


def experiment_main(spec_arg: str, runs_root: str, jobs: int, rerun: bool, variants: list[str] | None = None,
                    seeds: list[int] | None = None) -> int:
    """`exgrpo experiment`: returns the exit code (0 all runs finished, 1 some failed, 2 bad spec). `variants`:
    run only these of the spec's (`select_variants`), `seeds`: these seeds instead of the spec's (`select_seeds`);
    a run's folder is the same as in a whole run's, so finished runs are reused."""
    problem = runs_root_problem(Path(runs_root).expanduser())
    if problem:
        print(f"exgrpo experiment: {problem}", file=sys.stderr)
        return 2
    try:
        declared = load_spec(spec_arg)
        spec = select_seeds(select_variants(declared, variants), seeds)
        check_inputs(spec)  # every variant's start checks, before any run starts
    except SpecError as e:
        print("invalid experiment spec:\n  " + "\n  ".join(e.lines), file=sys.stderr)
        return 2
    from cluster.tracking import Tracker, default_tracking_uri
    from common.config.secrets import redact

    root = Path(runs_root).expanduser()
    out = root / spec.name
    problem = results_folder_problem(out)
    if problem:
        print(f"exgrpo experiment: {problem}", file=sys.stderr)
        return 2
    (out / "logs").mkdir(parents=True, exist_ok=True)
    tracker = Tracker(_base_tracking(spec, "uri") or default_tracking_uri(str(root)), "exgrpo")
    parent = tracker.start(spec.name, tags={"exgrpo.kind": "experiment"})
    tracker.log_params({"budget_rollouts": spec.budget_rollouts, "seeds": str(spec.seeds),
                        "variants": ",".join(spec.variants)})
    tracker.log_text(redact(yaml.safe_dump(spec.model_dump(), sort_keys=False)), "spec.yaml")
    todo = run_order(spec)
    print(f"[experiment] {spec.name}: {len(todo)} runs ({len(spec.variants)} variants x {len(spec.seeds)} seeds) "
          f"at {spec.budget_rollouts} rollouts each, {jobs} at a time; results in {out}", file=sys.stderr, flush=True)
    restore = STOP.install()
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            launch = Launch(root, out, parent, rerun, store=tracker.uri)
            results = list(pool.map(lambda vs: run_one(spec, vs[0], vs[1], launch), todo))
    finally:
        restore()
    if STOP.signal is not None:
        done = sum(r.ok for r in results)
        tracker.finish("KILLED")
        print(f"[experiment] {spec.name}: stopped by {STOP.signal}: {done} of {len(todo)} runs had finished, the "
              f"runs in flight stopped with a checkpoint; the same command again reuses the finished runs and starts "
              f"the others over", file=sys.stderr, flush=True)
        return 0
    text = table(spec, results)
    if seeds and sorted(seeds) != sorted(declared.seeds):
        text = (f"Seeds {' '.join(map(str, spec.seeds))} given with --seeds in place of the spec's "
                f"{len(declared.seeds)} ({' '.join(map(str, declared.seeds))}): the primary contrast's interval is "
                "not the one the spec declared.\n\n" + text)
    png = plot(spec, results, out / "accuracy_vs_rollouts.png")
    (out / "results.md").write_text(f"# {spec.name}\n\n{text}\n")
    (out / "results.json").write_text(json.dumps([r.__dict__ for r in results], indent=1))
    flags = (f"{' --variants ' + ' '.join(variants) if variants else ''}"
             f"{' --seeds ' + ' '.join(map(str, seeds)) if seeds else ''}")
    print(f"$ exgrpo experiment {spec_arg}{flags}\n{text}")
    if png is not None:
        print(f"plot: {png}")
        tracker.log_artifact(png)
    tracker.log_text(text, "results.md")
    failed = sum(not r.ok for r in results)
    tracker.finish("FAILED" if failed else "FINISHED")
    return 1 if failed else 0
