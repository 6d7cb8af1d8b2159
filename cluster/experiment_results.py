"""Reading an experiment's finished runs back from MLflow, and its report: tables, paired differences, a plot.

Each run gives its held-out curve, its final pass@1 with the evaluation's standard error, and what the buffer,
the learner and publications did and how stale its rollouts were (`MECHANISM`, `COSTS`, `LOSS`, `LAG`). The report
prints per-variant means ± seed sd, then the verdict lines (`differences`): the spec's primary contrast with its
plain 95% interval, every other paired difference Holm-adjusted as one family (`cluster.experiment_stats`), and
the best variant against the runner-up as description only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cluster.experiment_presets import PRESETS
from cluster.experiment_stats import Difference, holm, paired_difference


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
    lag: dict[str, float] = field(default_factory=dict)  # how stale its fresh rollouts were (see LAG)
    error: str = ""
    final_se: float = float("nan")  # the final evaluation's standard error of pass@1 (eval/pass_at_1_se)


def collect(store: str, variant: str, seed: int, name: str, run_id: str | None, wall_s: float) -> RunResult:
    """A finished run's held-out curve and totals, read back from its MLflow run `run_id` (None: none recorded) in
    the experiment's MLflow store `store` (its credentials, if any, already in this process's environment)."""
    from mlflow.tracking import MlflowClient

    if not run_id:
        return RunResult(variant, seed, name, ok=False, wall_s=wall_s, error="no MLflow run recorded")
    client = MlflowClient(tracking_uri=store)
    rollouts_at = {m.step: m.value for m in client.get_metric_history(run_id, "train/rollouts_total")}
    evals = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "eval/pass_at_1"))
    greedy = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "eval/greedy_accuracy"))
    if not evals:
        return RunResult(variant, seed, name, ok=False, wall_s=wall_s,
                         error="no held-out evaluation logged (set eval.every_steps in the spec's base)")
    curve = [(rollouts_at.get(step, 0.0), v) for step, v in evals]
    se = {m.step: m.value for m in client.get_metric_history(run_id, "eval/pass_at_1_se")}  # absent: older runs
    return RunResult(variant, seed, name, ok=True, wall_s=wall_s, rollouts=max(rollouts_at.values(), default=0.0),
                     final_pass1=evals[-1][1], final_se=se.get(evals[-1][0], float("nan")),
                     best_pass1=max(v for _, v in evals),
                     final_greedy=greedy[-1][1] if greedy else float("nan"), curve=curve,
                     mechanism=_mechanism(client, run_id), costs=_costs(client, run_id), loss=_loss(client, run_id),
                     lag=_lag(client, run_id))


MECHANISM = {
    "switch_step": "mixed mode on from step",
    "fresh_groups": "fresh groups trained",
    "mixed_groups": "mixed groups trained",
    "retired": "questions retired",
    "retired_pool": "retired from the pool",
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
included), so its advantage is 0; the replayed-token share is o*'s tokens over all tokens trained. Questions
retired have left the fresh stream; retired from the pool, their experience deleted (the same questions unless
buffer.retire_fresh=last_three_correct). The switch
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
with learner.loss.replay_loss=policy_loss: — under shaping). Printed when a spec varies the loss
(`LOSS_KEYS`)."""

LAG = {
    "mean": "mean lag",
    "lag_0": "share at lag 0",
    "lag_1": "share at lag 1",
    "lag_2+": "share at lag 2+",
    "spanning": "spanning weight updates",
}
"""Per run, from the `staleness/*` metrics it logged: how many policy versions its fresh rollouts were behind the
batch that trained them (`lag` in docs/algorithm.md's units), as the mean over its steps of `staleness/mean`, the
share of all its fresh rollouts at each lag (`staleness/lag_<k>` summed over steps) and the mean share generated
across a weight update (`staleness/spanning_fraction`). A synchronous run (buffer.max_lag=0) is all at lag 0; an
asynchronous variant's comparison with a synchronous one includes this difference."""

LOSS_KEYS = ("learner.loss.policy_loss", "learner.loss.replay_loss", "learner.loss.loss_agg",
             "learner.loss.shaping_beta", "learner.loss.clip_fresh")  # policy_loss covers its section's fields


def _loss(client, run_id: str) -> dict[str, float]:
    def mean(key: str) -> float:
        xs = _finite([m.value for m in client.get_metric_history(run_id, f"learner/{key}")])
        return statistics.fmean(xs) if xs else float("nan")

    return {key: mean(key) for key in LOSS}


def _lag(client, run_id: str) -> dict[str, float]:
    def history(key: str) -> list[float]:
        return _finite([m.value for m in client.get_metric_history(run_id, key)])

    keys = [k for k in client.get_run(run_id).data.metrics if k.startswith("staleness/lag_")]
    counts = {int(k.rsplit("_", 1)[1]): sum(history(k)) for k in keys}
    total = sum(counts.values())
    means, spanning = history("staleness/mean"), history("staleness/spanning_fraction")
    nan = float("nan")
    share = (lambda pick: sum(n for k, n in counts.items() if pick(k)) / total) if total else (lambda pick: nan)
    return {"mean": statistics.fmean(means) if means else nan, "lag_0": share(lambda k: k == 0),
            "lag_1": share(lambda k: k == 1), "lag_2+": share(lambda k: k >= 2),
            "spanning": statistics.fmean(spanning) if spanning else nan}


def _costs(client, run_id: str) -> dict[str, float]:
    def mean(key: str, scale: float = 1.0) -> float:
        xs = _finite([m.value for m in client.get_metric_history(run_id, key)])
        return statistics.fmean(xs) * scale if xs else float("nan")

    peak = _finite([m.value for m in client.get_metric_history(run_id, "learner/peak_memory_gib")])
    return {"publication_mb": mean("weights/bytes_full", 1e-6),
            "publish_blocking_s": mean("weights/publish_blocking_s"),
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
            "retired_pool": m.get("buffer/retired_from_pool", m.get("buffer/retired", 0.0)),
            "zero_signal": m.get("buffer/zero_signal_seen", 0.0) / trained if trained else nan,
            "replay_tokens": replay / both if both else nan,
            "valid_heldout": m.get("eval/valid_given_correct", nan),
            "valid_fresh": m.get("generator/valid_given_correct", nan),
            "valid_chosen": weighted("learner/replay_valid_chosen"),
            "valid_candidates": weighted("learner/replay_valid_candidates"),
            "entropy_valid_corr": statistics.fmean(corr) if corr else nan}



# ------------------------------------------------------------------------------------------ report


def _finite(xs: list[float]) -> list[float]:
    return [x for x in xs if not math.isnan(x)]


def _mean_sd(xs: list[float]) -> str:
    xs = _finite(xs)
    if not xs:
        return "—"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.3f} ± {sd:.3f}"


def _means_table(spec, results: list[RunResult], title: str, columns: dict[str, str],
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


def table(spec, results: list[RunResult]) -> str:
    """The report: per variant, mean ± sd over seeds and the evaluation's SE; the paired differences
    (`differences`); what the buffer did, what it cost and (where a variant sets the loss) what the loss did."""
    rows = ["| variant | runs | final pass@1 | eval SE | best pass@1 | final greedy | rollouts | wall s |",
            "|---" * 8 + "|"]
    for variant in spec.variants:
        mine = [r for r in results if r.variant == variant]
        ok = [r for r in mine if r.ok]
        failed = f" ({len(mine) - len(ok)} failed)" if len(ok) < len(mine) else ""
        ses = _finite([r.final_se for r in ok])
        se = f"{math.sqrt(statistics.fmean(x * x for x in ses)):.3f}" if ses else "—"  # root mean square
        rows.append(f"| {variant} | {len(ok)}{failed} | {_mean_sd([r.final_pass1 for r in ok])} | {se} | "
                    f"{_mean_sd([r.best_pass1 for r in ok])} | {_mean_sd([r.final_greedy for r in ok])} | "
                    f"{statistics.fmean([r.rollouts for r in ok]) if ok else float('nan'):.0f} | "
                    f"{statistics.fmean([r.wall_s for r in ok]) if ok else float('nan'):.0f} |")
    rows += differences(spec, results)
    counts = ("switch_step", "fresh_groups", "mixed_groups", "retired", "retired_pool")
    rows += _means_table(spec, results, "What the buffer did", MECHANISM, lambda r: r.mechanism,
                         lambda key, x: f"{x:.0f}" if key in counts else f"{x:.2f}")
    rows += _means_table(spec, results, "How stale the fresh rollouts were", LAG, lambda r: r.lag,
                         lambda key, x: f"{x:.2f}")
    rows += _means_table(spec, results, "What it cost", COSTS, lambda r: r.costs, lambda key, x: f"{x:.3g}")
    named = [PRESETS.get(v.get("preset"), {}) for v in spec.variants.values()]
    if any(k.startswith(LOSS_KEYS) for v in [spec.base, *spec.variants.values(), *named] for k in v):
        rows += _means_table(spec, results, "What the policy loss did", LOSS, lambda r: r.loss,
                             lambda key, x: f"{x:.3f}")
    for r in results:
        if not r.ok:
            rows.append(f"\n{r.name} failed: {r.error}")
    return "\n".join(rows)


def reference_variant(spec) -> str:
    """The variant the others are compared with: the spec's `reference`, else (or when --variants left it out)
    the first."""
    return spec.reference if spec.reference in spec.variants else next(iter(spec.variants))


def differences(spec, results: list[RunResult]) -> list[str]:
    """The verdict lines. First the spec's `primary` contrast (declared before the runs): its final pass@1
    difference paired by seed with the plain 95% t interval and p-value. Then every other paired difference (each
    variant against the reference, the spec's `compare` pairs and, where reasoning is checked, the validity
    differences) as one family, Holm-adjusted: each interval at the level Holm's step-down tests it at, with its
    adjusted p-value ("within noise" where the interval holds 0, i.e. adjusted p >= 0.05). Last, the best variant by
    mean and the runner-up, descriptive only: that pair is chosen after ranking, so no interval is given. Nothing
    for a one-variant spec."""
    finals = {v: {r.seed: r.final_pass1 for r in results if r.variant == v and r.ok} for v in spec.variants}
    if len(finals) < 2:
        return []
    primary = tuple(spec.primary) if spec.primary and all(v in finals for v in spec.primary) else None
    lines = [""]
    if primary:
        d = paired_difference(*primary, finals[primary[0]], finals[primary[1]])
        lines += ["Primary contrast, final pass@1 (declared in the spec before the runs; runs of one seed share the "
                  "data order and the evaluation questions; 95% t interval over seeds):", "",
                  f"- {d.line(_p_note(d.p)) if d else f'{primary[0]} − {primary[1]}: no seed where both finished'}",
                  ""]
    else:
        lines += [f"No primary contrast among the variants run (the spec's: "
                  f"{' − '.join(spec.primary) if spec.primary else 'none'}): every interval below is Holm-adjusted.",
                  ""]
    family = [("Final pass@1", d) for d in _pairs(spec, finals, primary)]
    family += [(title, d) for title, d in _reasoning_differences(spec, results)]
    adjusted, levels = holm([d.p for _, d in family])
    lines.append(f"Other paired differences, Holm-adjusted over these {sum(1 for p in adjusted if p == p)} intervals "
                 "(family-wise 95%: each interval at the level Holm's step-down tests it at, with its adjusted p):"
                 if family else "No other paired difference.")
    title = None
    for (t, d), p_adj, level in zip(family, adjusted, levels):
        if t != title:
            lines += ["", f"{t}:", ""]
            title = t
        note = "" if p_adj != p_adj else f", Holm: {100 * level:.4g}% interval, adjusted p {_p(p_adj)}"
        lines.append(f"- {(d.at_level(level) if level == level else d).line(note)}")
    ranked = sorted((v for v in finals if finals[v]), key=lambda v: -statistics.fmean(finals[v].values()))
    if len(ranked) >= 2:
        best, second = ranked[0], ranked[1]
        lines += ["", f"Best by mean final pass@1: {best} ({statistics.fmean(finals[best].values()):.3f}), runner-up "
                  f"{second} ({statistics.fmean(finals[second].values()):.3f}); descriptive only: the pair is chosen "
                  "after ranking, so no interval"]
    return lines


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 0.001 else "< 0.001"


def _p_note(p: float) -> str:
    return "" if p != p else f", p {_p(p)}"


def _pairs(spec, values: dict[str, dict[int, float]], skip: tuple[str, str] | None = None) -> list[Difference]:
    """Each variant with `values` minus the reference, then the spec's `compare` pairs; `skip` (the primary
    contrast, either way round) left out; pairs with no seed in common left out."""
    ref = reference_variant(spec)
    pairs = [(v, ref) for v in values if v != ref and ref in values]
    pairs += [(a, b) for a, b in spec.compare if a in values and b in values and ref not in (a, b)]
    out = []
    for a, b in pairs:
        if skip and {a, b} == set(skip):
            continue
        d = paired_difference(a, b, values[a], values[b])
        if d is not None:
            out.append(d)
    return out


def _reasoning_differences(spec, results: list[RunResult]) -> list[tuple[str, Difference]]:
    """Where the task checks reasoning (think_arith): the same paired differences for held-out valid given
    correct, and for o* valid among the variants that choose an o* (against the first of them)."""
    def per_seed(key: str) -> dict[str, dict[int, float]]:
        out = {v: {r.seed: r.mechanism.get(key, math.nan) for r in results if r.variant == v and r.ok}
               for v in spec.variants}
        return {v: {s: x for s, x in by.items() if math.isfinite(x)} for v, by in out.items() if _finite(by.values())}

    out = []
    heldout = per_seed("valid_heldout")
    if len(heldout) >= 2:
        out += [("Held-out valid given correct", d) for d in _pairs(spec, heldout)]
    chosen = per_seed("valid_chosen")
    if len(chosen) >= 2:
        first = next(iter(chosen))
        out += [("o* valid", d) for v in chosen if v != first
                for d in [paired_difference(v, first, chosen[v], chosen[first])] if d is not None]
    return out


def plot(spec, results: list[RunResult], path: Path) -> Path | None:
    """Held-out pass@1 against generated rollouts: mean over seeds, band = min..max over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for i, variant in enumerate(spec.variants):
        curves = [r.curve for r in results if r.variant == variant and r.ok and r.curve]
        if not curves:
            continue
        grid = np.linspace(max(c[0][0] for c in curves), min(c[-1][0] for c in curves), 50)  # no extrapolation
        ys = np.array([np.interp(grid, [x for x, _ in c], [y for _, y in c]) for c in curves])  # [seeds, 50]
        style = ("-", "--", ":")[i // 10 % 3]  # the colour cycle has 10 colours: the 11th variant is dashed
        line, = ax.plot(grid, ys.mean(0), style, label=f"{variant} ({len(curves)} seeds)")
        ax.fill_between(grid, ys.min(0), ys.max(0), alpha=0.2, color=line.get_color())
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
