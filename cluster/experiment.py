"""`exgrpo experiment SPEC.yaml`: named variants x seeds at an equal generated-rollout budget.

    exgrpo experiment ablations                     # the bundled spec (cluster/experiments/ablations.yaml)
    exgrpo experiment my_spec.yaml --jobs 2         # two runs at a time (e.g. on a cluster)
    exgrpo experiment ablations --variants exgrpo plain_replay   # only these variants of the spec

Every (variant, seed) is one `exgrpo train` subprocess that stops at the rollout budget, nested as an MLflow
child of one parent run; a finished run folder is reused (`--rerun` starts over). Results: a table and a plot
per variant, logged to the parent run; the exit code is non-zero when a run failed.
Details (the spec, the budget, the results): docs/internals.md#clusterexperimentpy
"""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

BUNDLED = Path(__file__).resolve().parent / "experiments"
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
    """Variant name -> its overrides ({} = the defaults)."""
    run_timeout_s: float = Field(6 * 3600, gt=0)
    """A run still going after this long is killed and reported as failed (its own stall limits come first)."""

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
        return v


@dataclass
class RunResult:
    variant: str
    seed: int
    name: str
    ok: bool
    wall_s: float = 0.0
    rollouts: float = float("nan")
    final_pass1: float = float("nan")
    best_pass1: float = float("nan")
    final_greedy: float = float("nan")
    curve: list[tuple[float, float]] = field(default_factory=list)  # (rollouts, held-out pass@1)
    mechanism: dict[str, float] = field(default_factory=dict)  # what the buffer did (see MECHANISM)
    costs: dict[str, float] = field(default_factory=dict)  # what the learner and publications cost (see COSTS)
    loss: dict[str, float] = field(default_factory=dict)  # what the policy loss did (see LOSS)
    error: str = ""


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
    _check_variants(spec)
    return spec


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
            lines.append(f"{where}: missing: {fields[where].description or 'required'}")
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


def _check_variants(spec: ExperimentSpec) -> None:
    from common.config import ConfigError, load_config

    problems = []
    for variant, values in spec.variants.items():
        try:
            load_config(None, overrides(spec.base) + overrides(values) + [f"total_rollouts={spec.budget_rollouts}"])
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
    for variant, values in spec.variants.items():
        cfg = load_config(None, overrides(spec.base) + overrides(values) + [f"total_rollouts={spec.budget_rollouts}"])
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


def run_name(spec: ExperimentSpec, variant: str, seed: int) -> str:
    return f"{spec.name}-{variant}-s{seed}"


def train_command(spec: ExperimentSpec, variant: str, seed: int, runs_root: Path, parent: str | None) -> list[str]:
    seeds = [f"{k}={seed}" for k in ("seed", "buffer.seed", "learner.seed", "generator.seed")]
    extra = [f"name={run_name(spec, variant, seed)}", f"checkpoint.runs_root={runs_root}",
             f"total_rollouts={spec.budget_rollouts}", "tracking.log_plots=false"]
    if parent:
        extra.append(f"tracking.parent_run_id={parent}")
    return [sys.executable, "-m", "cluster.cli", "train",
            *overrides(spec.base), *overrides(spec.variants[variant]), *seeds, *extra]


def run_one(spec: ExperimentSpec, variant: str, seed: int, runs_root: Path, out: Path, parent: str | None,
            rerun: bool) -> RunResult:
    name = run_name(spec, variant, seed)
    folder = runs_root / name
    state = _state(folder)
    if state.get("status") == "FINISHED" and not rerun:
        print(f"[experiment] {name}: finished earlier, reusing it", file=sys.stderr, flush=True)
        return collect(runs_root, variant, seed, name, wall_s=float(state.get("wall_s", float("nan"))))
    if folder.exists():
        import shutil

        shutil.rmtree(folder)  # an unfinished or --rerun attempt starts over
    log_path = out / "logs" / f"{name}.log"
    print(f"[experiment] {name}: starting (log {log_path})", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(train_command(spec, variant, seed, runs_root, parent), stdout=log,
                                stderr=subprocess.STDOUT, timeout=spec.run_timeout_s).returncode
        except subprocess.TimeoutExpired:
            return RunResult(variant, seed, name, ok=False, wall_s=time.monotonic() - t0,
                             error=f"killed after run_timeout_s={spec.run_timeout_s:.0f}s (see {log_path})")
    wall = time.monotonic() - t0
    if rc != 0:
        tail = log_path.read_text()[-600:].strip().splitlines()
        return RunResult(variant, seed, name, ok=False, wall_s=wall,
                         error=f"exit {rc}: {tail[-1] if tail else 'no output'} (see {log_path})")
    _update_state(folder, wall_s=wall)
    print(f"[experiment] {name}: done in {wall:.0f}s", file=sys.stderr, flush=True)
    return collect(runs_root, variant, seed, name, wall_s=wall)


def collect(runs_root: Path, variant: str, seed: int, name: str, wall_s: float) -> RunResult:
    """A finished run's held-out curve and totals, read back from its MLflow run."""
    from mlflow.tracking import MlflowClient

    from cluster.tracking import default_tracking_uri

    run_id = _state(runs_root / name).get("mlflow_run_id")
    if not run_id:
        return RunResult(variant, seed, name, ok=False, wall_s=wall_s, error="no MLflow run recorded")
    client = MlflowClient(tracking_uri=default_tracking_uri(str(runs_root)))
    rollouts_at = {m.step: m.value for m in client.get_metric_history(run_id, "train/rollouts_total")}
    evals = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "eval/pass_at_1"))
    greedy = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "eval/greedy_accuracy"))
    if not evals:
        return RunResult(variant, seed, name, ok=False, wall_s=wall_s,
                         error="no held-out evaluation logged (set eval.every_steps in the spec's base)")
    curve = [(rollouts_at.get(step, 0.0), v) for step, v in evals]
    return RunResult(variant, seed, name, ok=True, wall_s=wall_s, rollouts=max(rollouts_at.values(), default=0.0),
                     final_pass1=evals[-1][1], best_pass1=max(v for _, v in evals),
                     final_greedy=greedy[-1][1] if greedy else float("nan"), curve=curve,
                     mechanism=_mechanism(client, run_id), costs=_costs(client, run_id), loss=_loss(client, run_id))


MECHANISM = {
    "switch_step": "mixed mode on from step",
    "fresh_groups": "fresh groups trained",
    "mixed_groups": "mixed groups trained",
    "retired": "questions retired",
    "zero_signal": "groups with no signal",
    "replay_tokens": "replayed-token share",
    "valid_heldout": "held-out valid given correct",
    "valid_fresh": "fresh valid given correct",
    "valid_chosen": "o* valid",
    "valid_candidates": "candidates valid",
    "entropy_valid_corr": "corr(entropy, valid)",
}
"""Per run, read back from MLflow: what replay changed. A fresh group is a question issued as new (its count
bounds the distinct questions seen in a first epoch); a group with no signal has all rewards equal (o*
included), so its advantage is 0; the replayed-token share is o*'s tokens over all tokens trained. The switch
step is left out (—) for a run that replayed nothing: GRPO's buffer switches too, but has nothing to replay.
Where the task checks reasoning (think_arith: every equation of the reasoning holds): the share of correct
responses with valid reasoning on the held-out set (last evaluation) and among fresh training rollouts (whole
run); for mixed groups, the share of chosen o* with valid reasoning against the mean share over the candidates
it was chosen from (what a random choice gives), and the mean per-step correlation between a scored
candidate's entropy and its validity (negative: lower entropy, more often valid)."""


COSTS = {
    "publication_mb": "MB per publication",
    "publish_blocking_s": "publication s (rank 0 busy)",
    "step_s": "learner step s",
    "peak_gib": "learner peak GiB",
}
"""Per run, read back from MLflow: the mean bytes a publication carried (`weights/bytes_full`: the whole model, or
the adapters with `learner.lora`), the mean seconds learner rank 0 was busy publishing, the mean learner step
time, and the learner's peak memory (`learner/peak_memory_gib`: the largest rank's CUDA max allocated, or its peak
RSS on the CPU)."""


LOSS = {
    "clip_frac": "fresh tokens clipped or gated",
    "fresh_ratio_mean": "fresh importance weight",
    "replay_clip_frac": "replayed tokens clipped or gated",
    "replay_weight_mean": "replayed weight",
}
"""Per run, the mean over its steps of the policy loss's own metrics (`learner/clip_frac`, ...): the share of fresh
tokens whose clip or gate acted (docs/algorithm.md, Policy losses, says what each loss counts), the mean importance
weight of fresh tokens (gspo: the row's sequence ratio), and the same for replayed tokens (clipped or gated only
with learner.replay_loss=policy_loss: — under shaping). Printed when a spec varies the loss
(`LOSS_KEYS`)."""

LOSS_KEYS = ("learner.policy_loss", "learner.replay_loss", "learner.loss_agg", "learner.shaping_beta",
             "learner.clip_low", "learner.clip_high", "learner.clip_fresh")


def _loss(client, run_id: str) -> dict[str, float]:
    def mean(key: str) -> float:
        xs = _finite([m.value for m in client.get_metric_history(run_id, f"learner/{key}")])
        return statistics.fmean(xs) if xs else float("nan")

    return {key: mean(key) for key in LOSS}


def _costs(client, run_id: str) -> dict[str, float]:
    def mean(key: str, scale: float = 1.0) -> float:
        xs = _finite([m.value for m in client.get_metric_history(run_id, key)])
        return statistics.fmean(xs) * scale if xs else float("nan")

    peak = _finite([m.value for m in client.get_metric_history(run_id, "learner/peak_memory_gib")])
    return {"publication_mb": mean("weights/bytes_full", 1e-6), "publish_blocking_s": mean("weights/publish_blocking_s"),
            "step_s": mean("learner/step_time_s"), "peak_gib": max(peak) if peak else float("nan")}


def _mechanism(client, run_id: str) -> dict[str, float]:
    def history(key: str) -> list:
        return client.get_metric_history(run_id, key)

    m = client.get_run(run_id).data.metrics
    on = [x.step for x in history("train/mixed_mode") if x.value > 0]
    trained, mixed = m.get("buffer/trained", 0.0), m.get("buffer/trained_mixed", 0.0)
    replay = sum(x.value for x in history("learner/replay_tokens"))
    both = replay + sum(x.value for x in history("learner/fresh_tokens"))
    nan = float("nan")

    def weighted(key: str) -> float:  # a per-step share, weighted by the groups it was measured on
        w = {x.step: x.value for x in history("learner/replay_valid_groups")}
        pairs = [(x.value, w.get(x.step, 0.0)) for x in history(key) if not math.isnan(x.value)]
        total = sum(n for _, n in pairs)
        return sum(v * n for v, n in pairs) / total if total else nan

    corr = _finite([x.value for x in history("learner/entropy_valid_corr")])
    return {"switch_step": float(min(on)) if on and mixed else nan, "fresh_groups": trained - mixed,
            "mixed_groups": mixed, "retired": m.get("buffer/retired", 0.0),
            "zero_signal": m.get("buffer/zero_signal_seen", 0.0) / trained if trained else nan,
            "replay_tokens": replay / both if both else nan,
            "valid_heldout": m.get("eval/valid_given_correct", nan), "valid_fresh": m.get("generator/valid_given_correct", nan),
            "valid_chosen": weighted("learner/replay_valid_chosen"),
            "valid_candidates": weighted("learner/replay_valid_candidates"),
            "entropy_valid_corr": statistics.fmean(corr) if corr else nan}


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


# ------------------------------------------------------------------------------------------ results


def _finite(xs: list[float]) -> list[float]:
    return [x for x in xs if not math.isnan(x)]


def _mean_sd(xs: list[float]) -> str:
    xs = _finite(xs)
    if not xs:
        return "—"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.3f} ± {sd:.3f}"


def _means_table(spec: ExperimentSpec, results: list[RunResult], title: str, columns: dict[str, str],
                 values: Callable[[RunResult], dict[str, float]], fmt: Callable[[str, float], str]) -> list[str]:
    """A table of per-variant means over the successful runs (— where no run measured a column)."""
    rows = ["", f"{title} (mean over seeds):", "",
            "| variant | " + " | ".join(columns.values()) + " |", "|---" * (len(columns) + 1) + "|"]
    for variant in spec.variants:
        ok = [r for r in results if r.variant == variant and r.ok]
        cells = []
        for key in columns:
            xs = _finite([values(r).get(key, float("nan")) for r in ok])
            cells.append(fmt(key, statistics.fmean(xs)) if xs else "—")
        rows.append(f"| {variant} | " + " | ".join(cells) + " |")
    return rows


def table(spec: ExperimentSpec, results: list[RunResult]) -> str:
    rows = ["| variant | runs | final pass@1 | best pass@1 | final greedy | rollouts | wall s |",
            "|---|---|---|---|---|---|---|"]
    for variant in spec.variants:
        mine = [r for r in results if r.variant == variant]
        ok = [r for r in mine if r.ok]
        failed = f" ({len(mine) - len(ok)} failed)" if len(ok) < len(mine) else ""
        rows.append(f"| {variant} | {len(ok)}{failed} | {_mean_sd([r.final_pass1 for r in ok])} | "
                    f"{_mean_sd([r.best_pass1 for r in ok])} | {_mean_sd([r.final_greedy for r in ok])} | "
                    f"{statistics.fmean([r.rollouts for r in ok]) if ok else float('nan'):.0f} | "
                    f"{statistics.fmean([r.wall_s for r in ok]) if ok else float('nan'):.0f} |")
    counts = ("switch_step", "fresh_groups", "mixed_groups", "retired")
    rows += _means_table(spec, results, "What the buffer did", MECHANISM, lambda r: r.mechanism,
                         lambda key, x: f"{x:.0f}" if key in counts else f"{x:.2f}")
    rows += _means_table(spec, results, "What it cost", COSTS, lambda r: r.costs, lambda key, x: f"{x:.3g}")
    if any(k.startswith(LOSS_KEYS) for v in [spec.base, *spec.variants.values()] for k in v):
        rows += _means_table(spec, results, "What the policy loss did", LOSS, lambda r: r.loss,
                             lambda key, x: f"{x:.3f}")
    for r in results:
        if not r.ok:
            rows.append(f"\n{r.name} failed: {r.error}")
    return "\n".join(rows)


def plot(spec: ExperimentSpec, results: list[RunResult], path: Path) -> Path | None:
    """Held-out pass@1 against generated rollouts: mean over seeds, band = min..max over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for variant in spec.variants:
        curves = [r.curve for r in results if r.variant == variant and r.ok and r.curve]
        if not curves:
            continue
        grid = np.linspace(max(c[0][0] for c in curves), min(c[-1][0] for c in curves), 50)  # no extrapolation
        ys = np.array([np.interp(grid, [x for x, _ in c], [y for _, y in c]) for c in curves])  # [seeds, 50]
        ax.plot(grid, ys.mean(0), label=f"{variant} ({len(curves)} seeds)")
        ax.fill_between(grid, ys.min(0), ys.max(0), alpha=0.2)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("generated rollouts trained on")
    ax.set_ylabel("held-out pass@1")
    ax.set_title(f"{spec.name}: held-out pass@1 at equal rollouts")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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


def experiment_main(spec_arg: str, runs_root: str, jobs: int, rerun: bool, variants: list[str] | None = None) -> int:
    """`exgrpo experiment`: returns the exit code (0 all runs finished, 1 some failed, 2 bad spec). `variants`:
    run only these of the spec's (`select_variants`); their run folders are the same as in a whole run's."""
    try:
        spec = select_variants(load_spec(spec_arg), variants)
        check_inputs(spec)  # every variant's start checks, before any run starts
    except SpecError as e:
        print("invalid experiment spec:\n  " + "\n  ".join(e.lines), file=sys.stderr)
        return 2
    from cluster.tracking import Tracker, default_tracking_uri

    root = Path(runs_root).expanduser()
    out = root / spec.name
    (out / "logs").mkdir(parents=True, exist_ok=True)
    tracker = Tracker(default_tracking_uri(str(root)), "exgrpo")
    parent = tracker.start(spec.name, tags={"exgrpo.kind": "experiment"})
    tracker.log_params({"budget_rollouts": spec.budget_rollouts, "seeds": str(spec.seeds),
                        "variants": ",".join(spec.variants)})
    tracker.log_text(yaml.safe_dump(spec.model_dump(), sort_keys=False), "spec.yaml")
    todo = [(v, s) for v in spec.variants for s in spec.seeds]
    print(f"[experiment] {spec.name}: {len(todo)} runs ({len(spec.variants)} variants x {len(spec.seeds)} seeds) "
          f"at {spec.budget_rollouts} rollouts each, {jobs} at a time; results in {out}", file=sys.stderr, flush=True)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda vs: run_one(spec, vs[0], vs[1], root, out, parent, rerun), todo))
    text = table(spec, results)
    png = plot(spec, results, out / "accuracy_vs_rollouts.png")
    (out / "results.md").write_text(f"# {spec.name}\n\n{text}\n")
    (out / "results.json").write_text(json.dumps([r.__dict__ for r in results], indent=1))
    print(f"$ exgrpo experiment {spec_arg}{' --variants ' + ' '.join(variants) if variants else ''}\n{text}")
    if png is not None:
        print(f"plot: {png}")
        tracker.log_artifact(png)
    tracker.log_text(text, "results.md")
    failed = sum(not r.ok for r in results)
    tracker.finish("FAILED" if failed else "FINISHED")
    return 1 if failed else 0
