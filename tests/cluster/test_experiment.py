"""`exgrpo experiment`: spec checks (fast), the paired differences and their intervals (worked by hand), and a
short real experiment (two variants, one seed, a two-step rollout budget) that writes its table, plot and nested
MLflow runs. It never asserts which variant wins."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.cli import main
from cluster.experiment import (BUNDLED, PRESETS, SpecError, _state, code_changed, code_version, load_spec,
                               overrides, run_order, runs_root_problem, select_seeds, select_variants, settings_changed,
                               variant_overrides)
from cluster.experiment_results import RunResult, differences, table
from cluster.experiment_stats import holm, paired_difference, t_quantile
from tests.cluster.runs import ROOT, mlflow_client


def write(tmp_path: Path, spec: dict) -> str:
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(spec))
    return str(p)


def test_the_bundled_spec_loads_and_bad_specs_say_what_to_change(tmp_path):
    spec = load_spec("ablations")
    assert {"exgrpo", "grpo", "uniform_questions", "random_trajectory", "no_shaping"} <= set(spec.variants)
    for path in sorted(BUNDLED.glob("*.yaml")):  # every bundled spec validates every run's config
        want = {"lora_vs_full": {"full", "lora"}, "losses": {f"{a}_{loss}" for a in ("exgrpo", "grpo") for loss in
                                                             ("ppo_clip", "gspo", "cispo", "sapo")}
                }.get(path.stem, {"exgrpo", "grpo"})
        assert want <= set(load_spec(path.stem).variants), path
    for name in ("ablations", "multi_epoch", "paper_epochs"):  # retirement isolated: ExGRPO with buffer.retire=false, nothing else
        assert load_spec(name).variants["exgrpo_no_retire"] == {"preset": "exgrpo_paper", "buffer.retire": False}
    assert spec.variants["su01"] == {"preset": "exgrpo_paper", "buffer.store_below": 2, "buffer.retire_above": 4,
                                     "buffer.replay_ratio": 0.25, "buffer.k_fresh_only": True,
                                     "buffer.retire_fresh": "last_three_correct"}
    assert overrides({"learner.loss.shaping_beta": None, "buffer.replay_ratio": 0.25}) == [
        "learner.loss.shaping_beta=null", "buffer.replay_ratio=0.25"]
    base = dict(name="t", budget_rollouts=10, seeds=[0], variants={"a": {}})
    with pytest.raises(SpecError, match=r"variants.b: buffer.grup_size: unknown field"):
        load_spec(write(tmp_path, {**base, "variants": {"a": {}, "b": {"buffer.grup_size": 3}}, "primary": ["a", "b"]}))
    with pytest.raises(SpecError, match="budget_rollouts"):
        load_spec(write(tmp_path, {**base, "budget_rollouts": 0}))
    with pytest.raises(SpecError, match="name"):
        load_spec(write(tmp_path, {**base, "name": "../x"}))
    with pytest.raises(SpecError, match="no such spec file .*bundled specs: ablations"):
        load_spec(str(tmp_path / "missing.yaml"))


def test_variants_runs_a_subset_of_the_spec_and_a_wrong_name_says_which_exist(tmp_path):
    spec = load_spec("ablations")
    assert list(select_variants(spec, ["plain_replay", "exgrpo"]).variants) == ["exgrpo", "plain_replay"]
    assert select_variants(spec, None) is spec
    with pytest.raises(SpecError, match=r"--variants: plain: not a variant of ablations \(its variants: exgrpo, "):
        select_variants(spec, ["exgrpo", "plain"])
    p = subprocess.run([sys.executable, "-m", "cluster.cli", "experiment", "ablations", "--variants", "plain",
                        "--runs-root", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--variants: plain: not a variant" in p.stderr


def test_seeds_replace_the_specs_own_and_a_seed_twice_is_refused(tmp_path):
    spec = load_spec("small_set")
    six = select_seeds(select_variants(spec, ["exgrpo", "plain_replay"]), [0, 1, 2, 3, 4, 5])
    assert six.seeds == [0, 1, 2, 3, 4, 5] and list(six.variants) == ["exgrpo", "plain_replay"]
    assert six.reference == spec.reference and select_seeds(spec, None) is spec
    with pytest.raises(SpecError, match=r"--seeds: \[0, 1, 1\]: each seed once"):
        select_seeds(spec, [0, 1, 1])
    p = subprocess.run([sys.executable, "-m", "cluster.cli", "experiment", "small_set", "--seeds", "3", "3",
                        "--runs-root", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--seeds: [3, 3]: each seed once" in p.stderr


@pytest.mark.slow
def test_a_short_experiment_writes_its_table_plot_and_nested_runs(tmp_path, capsys, joined):
    # the runs log to a store of the spec's own (tracking.uri in the base), not the runs root's default one: the
    # parent run and the results are read there too
    (tmp_path / "store").mkdir()
    store = f"sqlite:///{tmp_path}/store/mlflow.db"
    spec = dict(name="mini", budget_rollouts=256, seeds=[0], primary=["exgrpo", "grpo"],
                base={"total_steps": 50, "checkpoint.every_steps": 0, "eval.every_steps": 1, "eval.questions": 16,
                      "eval.samples": 2, "generator.engine.kind": "transformers", "cluster.address": joined.address,
                      "tracking.uri": store},
                variants={"exgrpo": {}, "grpo": {"buffer.replay_ratio": 0, "buffer.collect": False,
                                                 "learner.loss.policy_loss": "cispo"}})
    runs = tmp_path / "runs"
    spec_file = write(tmp_path, spec)
    cmd = [sys.executable, "-m", "cluster.cli", "experiment", spec_file, "--runs-root", str(runs)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=joined.env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results, rest = out.stdout.split("What the buffer did")
    mechanism, rest = rest.split("How stale the fresh rollouts were")
    lag, costs = rest.split("What it cost")
    costs, loss = costs.split("What the policy loss did")  # a variant sets learner.loss.policy_loss: the loss's table
    rows = [line for line in results.splitlines() if line.startswith(("| exgrpo", "| grpo"))]
    assert len(rows) == 2 and all("| 1 |" in r for r in rows), out.stdout
    assert all(0 < float(r.split(" | ")[3]) < 0.2 for r in rows), results  # the evaluation's SE, logged by each run
    # one seed: the primary contrast without an interval; the reference's line is the primary's, not printed twice
    verdicts = [line for line in results.splitlines() if line.startswith("- ")]
    assert len(verdicts) == 1 and verdicts[0].startswith("- exgrpo − grpo = "), results
    assert verdicts[0].endswith("(1 seed: no interval)") and "No other paired difference." in results
    assert "Best by mean final pass@1: " in results and "so no interval" in results
    # the runs started seed by seed in the order fixed by the seed
    started = [line.split()[1].rstrip(":") for line in out.stderr.splitlines() if line.endswith(".log)")]
    assert started == [f"mini-{v}-s{s}" for v, s in run_order(load_spec(spec_file))], out.stderr
    # the lag profile from each run's staleness/* metrics: asynchronous (max_lag 1), so every fresh rollout at lag
    # 0 or 1: the shares sum to 1
    lags = {line.split(" | ")[0].strip("| "): [float(x) for x in line.strip(" |").split(" | ")[1:]]
            for line in lag.splitlines() if line.startswith(("| exgrpo", "| grpo"))}
    assert set(lags) == {"exgrpo", "grpo"}, lag
    for mean, at0, at1, at2, _ in lags.values():
        assert 0 <= mean <= 1 and at2 == 0 and at0 + at1 == pytest.approx(1, abs=0.011), lag
    grpo = [line for line in mechanism.splitlines() if line.startswith("| grpo")]
    # GRPO never replays: no mixed group, no replayed token, nothing retired (collect=false); every group fresh
    assert len(grpo) == 1 and grpo[0].split(" | ")[1:5] == ["—", "32", "0", "0"], mechanism
    # MB per publication, publication s, learner step s, learner peak GiB: read back from each run, all measured
    cost_rows = [line for line in costs.splitlines() if line.startswith(("| exgrpo", "| grpo"))]
    assert len(cost_rows) == 2 and all(float(c) > 0 for r in cost_rows for c in r.strip(" |").split(" | ")[1:]), costs
    # fresh clipped or gated share, fresh weight, replayed clipped (— under shaping), replayed weight (— for GRPO)
    loss_rows = {line.split(" | ")[0].strip("| "): line.strip(" |").split(" | ")[1:] for line in loss.splitlines()
                 if line.startswith(("| exgrpo", "| grpo"))}
    assert 0 <= float(loss_rows["exgrpo"][0]) <= 1 and float(loss_rows["exgrpo"][1]) > 0, loss
    assert loss_rows["exgrpo"][2] == "—" and (loss_rows["exgrpo"][3] == "—" or float(loss_rows["exgrpo"][3]) > 0), loss
    assert loss_rows["grpo"][2:] == ["—", "—"] and 0 <= float(loss_rows["grpo"][0]) <= 1, loss
    assert (runs / "mini" / "results.md").is_file() and (runs / "mini" / "accuracy_vs_rollouts.png").is_file()

    assert not (runs / "mlflow.db").exists()  # nothing in the default store
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name("exgrpo")
    all_runs = client.search_runs([exp.experiment_id])
    parent = [r for r in all_runs if r.info.run_name == "mini"]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    children = [r for r in all_runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id]
    assert sorted(r.info.run_name for r in children) == ["mini-exgrpo-s0", "mini-grpo-s0"]
    for r in children:
        m = r.data.metrics
        # the equal budget stopped it: at least 256 generated rollouts, far fewer steps than total_steps
        assert m["train/rollouts_total"] >= 256 and m["policy/version"] < 10
        assert "eval/pass_at_1" in m
    assert {a.path for a in client.list_artifacts(parent[0].info.run_id)} >= {"results.md", "spec.yaml"}

    # reuses finished runs (in-process: the call above is the user's path; this one only reads the runs back)
    assert main(["experiment", spec_file, "--runs-root", str(runs)]) == 0
    assert capsys.readouterr().err.count("finished earlier, reusing it") == 2
    state = _state(runs / "mini-grpo-s0")
    assert "buffer.replay_ratio=0" in state["settings"]  # what the reuse is checked against, with the code
    assert state["code_version"] == code_version() and "data.seed=0" in state["settings"]


def test_a_finished_run_whose_settings_changed_is_not_reused():
    then = ["learner.optim.lr=0.001", "seed=0", "name=x-exgrpo-s0"]
    assert settings_changed(None, then) is None  # a run from before the record: reused as before
    assert settings_changed(then, list(then)) is None
    assert settings_changed(then, ["learner.optim.lr=0.0001", "seed=0", "name=x-exgrpo-s0"]) == \
        "now learner.optim.lr=0.0001; then learner.optim.lr=0.001"
    assert settings_changed(then, [*then, "buffer.retire=false"]) == "now buffer.retire=false"


@pytest.mark.parametrize("content, says", [
    (b"name: caf\xe9\n", "s.yaml, line 1: not a text file (byte 9 is not UTF-8); an experiment spec is a YAML file"),
    (b"\x00\x01\x02\xff\xfe", "not a text file"),
    (b"name: a\nseeds: [0]\nseeds: [1]\n", "s.yaml, line 3: seeds is given twice (lines 2 and 3)"),
    (b"name: a\n\tseeds: [0]\n", "s.yaml, line 2"),
])
def test_an_unreadable_spec_is_answered_with_its_file_and_line(tmp_path, content, says):
    (tmp_path / "s.yaml").write_bytes(content)
    p = subprocess.run([sys.executable, "-m", "cluster.cli", "experiment", str(tmp_path / "s.yaml")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and says in p.stderr, p.stderr


def test_an_empty_spec_and_a_misspelt_key_are_answered_in_the_spec_s_terms(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(SpecError, match=r"empty.yaml: empty; a spec is a mapping of name, budget_rollouts, seeds, "
                                        r"base, variants, run_timeout_s, reference, compare, primary \(name, budget_rollouts, "
                                        r"seeds, variants required; cluster/experiments/ablations.yaml is one\)"):
        load_spec(str(tmp_path / "empty.yaml"))
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, dict(name="t", budget_rollouts=10, seeds=[0], variant={"a": {}})))
    assert e.value.lines == ["variants: missing: Variant name -> its overrides ({} = the defaults); `preset: NAME` "
                             "takes a named set of overrides first (`PRESETS`: exgrpo_paper, grpo_paper).",
                             "variant: unknown field; did you mean variants?"]


def test_an_experiment_never_writes_into_a_folder_of_its_name_that_holds_a_users_files(tmp_path, capsys):
    """`<runs root>/<spec name>` is where the results and logs go: a folder there holding anything an experiment does
    not write is refused before any run starts, and left as it was."""
    spec = write(tmp_path, dict(name="mine", budget_rollouts=64, seeds=[0], variants={"a": {}}))
    (tmp_path / "runs" / "mine" / "logs").mkdir(parents=True)
    (tmp_path / "runs" / "mine" / "results.md").write_text("my notes")
    (tmp_path / "runs" / "mine" / "logs" / "notes.txt").write_text("mine")
    assert main(["experiment", spec, "--runs-root", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert (f"exgrpo experiment: {tmp_path}/runs/mine holds files no experiment wrote (logs/notes.txt); the "
            "experiment writes its results and logs there: move them, or give --runs-root another folder") in err, err
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "runs").rglob("*")) == [
        "runs/mine", "runs/mine/logs", "runs/mine/logs/notes.txt", "runs/mine/results.md"]
    assert (tmp_path / "runs" / "mine" / "results.md").read_text() == "my notes"


def test_experiment_help_lists_the_bundled_specs_and_the_defaults():
    p = subprocess.run([sys.executable, "-m", "cluster.cli", "experiment", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    text = " ".join(p.stdout.split())
    assert p.returncode == 0 and "(default: runs)" in text and "(default: 1)" in text, p.stdout
    assert all(f.stem in text for f in BUNDLED.glob("*.yaml")), p.stdout


# ------------------------------------------------------------------------------ statistics (worked by hand)


def test_the_t_quantile_matches_its_closed_forms_and_the_table():
    # df 1 is the Cauchy distribution: P(T <= q) = 1/2 + atan(q)/pi, so q = tan(pi * (0.975 - 0.5)) = 12.7062
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(0.475 * math.pi), abs=1e-8)
    assert t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-4)
    # df 2: P(|T| <= q) = q / sqrt(q^2 + 2) = 0.95, so q = sqrt(2 * 0.95^2 / (1 - 0.95^2)) = sqrt(18.5128) = 4.3027
    assert t_quantile(0.975, 2) == pytest.approx(math.sqrt(2 * 0.9025 / 0.0975), abs=1e-8)
    # printed tables (two-sided 95%): df 3, 4, 10, 30; a large df tends to the normal's 1.95996
    for df, q in [(3, 3.1824), (4, 2.7764), (10, 2.2281), (30, 2.0423), (2000, 1.9612)]:
        assert t_quantile(0.975, df) == pytest.approx(q, abs=1e-4), df
    assert t_quantile(0.5, 5) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="0.5 <= p < 1"):
        t_quantile(0.3, 3)


def test_a_paired_difference_and_its_interval_worked_by_hand():
    # d = 0.01, 0.03, 0.02: mean 0.02, sd 0.01, SE 0.01/sqrt(3) = 0.005774; t(0.975, 2) = 4.3027:
    # half-width 0.024841, interval [-0.004841, 0.044841]: holds 0
    a, b = {0: 0.56, 1: 0.58, 2: 0.57}, {0: 0.55, 1: 0.55, 2: 0.55}
    d = paired_difference("a", "b", a, b)
    assert (d.seeds, d.mean, d.lo, d.hi) == pytest.approx((3, 0.02, -0.004841, 0.044841), abs=2e-6)
    assert not d.beyond_noise and d.line() == "a − b = +0.020 [−0.005, +0.045] (3 seeds): within noise"
    # d = 0.04, 0.05, 0.06, 0.05: mean 0.05, sd sqrt(2e-4 / 3) = 0.0081650, SE 0.0040825; t(0.975, 3) = 3.18245:
    # half-width 0.012992, interval [0.037008, 0.062992]. Unpaired, the two variants' seed sds (0.12 and 0.13)
    # would swamp it: pairing by seed cancels what the runs of one seed share.
    a, b = {0: 0.44, 1: 0.65, 2: 0.36, 3: 0.55}, {0: 0.40, 1: 0.60, 2: 0.30, 3: 0.50}
    d = paired_difference("exgrpo", "grpo", a, b)
    assert (d.mean, d.lo, d.hi) == pytest.approx((0.05, 0.037008, 0.062992), abs=2e-6)
    assert d.beyond_noise and d.line() == "exgrpo − grpo = +0.050 [+0.037, +0.063] (4 seeds)"
    # negative, beyond noise: the same with the roles swapped
    swapped = paired_difference("grpo", "exgrpo", b, a)
    assert swapped.line() == "grpo − exgrpo = −0.050 [−0.063, −0.037] (4 seeds)"
    # only seeds both have count (a failed run is absent, a nan left out); one seed: no interval; none: None
    d = paired_difference("a", "b", {0: 0.5, 1: 0.7, 2: float("nan")}, {0: 0.4, 2: 0.5, 3: 0.6})
    assert d.seeds == 1 and d.line() == "a − b = +0.100 (1 seed: no interval)"
    assert paired_difference("a", "b", {0: 0.5}, {1: 0.5}) is None


def run(variant: str, seed: int, final: float, se: float = float("nan"), ok: bool = True) -> RunResult:
    return RunResult(variant, seed, f"t-{variant}-s{seed}", ok=ok, rollouts=100, final_pass1=final, best_pass1=final,
                     final_greedy=final, final_se=se)


def test_holm_adjusts_a_family_of_p_values_worked_by_hand():
    # p = 0.01, 0.04, 0.03, 0.20 (m = 4, alpha 0.05), ascending 0.01, 0.03, 0.04, 0.20:
    #   adjusted: 4 x 0.01 = 0.04; max(0.04, 3 x 0.03) = 0.09; max(0.09, 2 x 0.04 = 0.08) = 0.09; 1 x 0.20 = 0.20
    #   step-down: 0.01 < 0.05/4 = 0.0125 rejected (tested at 1 - 0.0125 = 98.75%); 0.03 >= 0.05/3: stops there, so
    #   it and every later one get 1 - 0.05/3 = 98.33% (their intervals hold 0, as their adjusted p >= 0.05)
    # nan is not in the family.
    adjusted, levels = holm([0.01, 0.04, 0.03, float("nan"), 0.20])
    assert adjusted[:3] + adjusted[4:] == pytest.approx([0.04, 0.09, 0.09, 0.20])
    assert levels[:3] + levels[4:] == pytest.approx([0.9875, 1 - 0.05 / 3, 1 - 0.05 / 3, 1 - 0.05 / 3])
    assert math.isnan(adjusted[3]) and math.isnan(levels[3])
    # the brief's case: p = 0.028 alone is 0.252 after Bonferroni over 9; Holm gives the smallest of 9 the same
    assert holm([0.028] + [0.5] * 8)[0][0] == pytest.approx(0.252)
    # a paired difference's p-value: d = 0.01, 0.03, 0.02: t = 0.02 / (0.01 / sqrt 3) = 3.4641 with 2 df,
    # P(|T| <= t) = t / sqrt(t^2 + 2) = 3.4641 / 3.7417 = 0.92582, p = 0.07418
    d = paired_difference("a", "b", {0: 0.56, 1: 0.58, 2: 0.57}, {0: 0.55, 1: 0.55, 2: 0.55})
    assert d.p == pytest.approx(0.07418, abs=1e-5)
    # its interval at Holm's 98.33%: t(1 - 0.05/6, 2) = sqrt(2 q^2 / (1 - q^2)) with q = 1 - 0.05/3:
    # sqrt(2 x 0.96694 / 0.03306) = 7.6489, half-width 7.6489 x 0.005774 = 0.044161
    q = 1 - 0.05 / 3
    wide = d.at_level(q)
    assert wide.hi - wide.mean == pytest.approx(math.sqrt(2 * q * q / (1 - q * q)) * 0.01 / math.sqrt(3), abs=1e-7)
    assert wide.hi - wide.mean == pytest.approx(0.044161, abs=2e-6)


def test_the_report_prints_the_primary_contrast_then_holm_adjusted_lines(tmp_path):
    spec = load_spec(write(tmp_path, dict(name="t", budget_rollouts=10, seeds=[0, 1, 2], primary=["grpo", "exgrpo"],
                                          compare=[["plain", "grpo"]], variants={
        "exgrpo": {}, "grpo": {"buffer.replay_ratio": 0}, "plain": {"buffer.retire": False}})))
    results = [run("exgrpo", 0, 0.55, 0.006), run("exgrpo", 1, 0.57, 0.008), run("exgrpo", 2, 0.56),
               run("grpo", 0, 0.56), run("grpo", 1, 0.60), run("grpo", 2, 0.58),  # d = 0.01, 0.03, 0.02
               run("plain", 0, 0.60), run("plain", 1, 0.62), run("plain", 2, 0.0, ok=False)]  # d = 0.05, 0.05
    # primary grpo − exgrpo, plain 95%: the first test's numbers, [-0.005, +0.045], p 0.074 (worked above).
    # The family: plain − exgrpo (d = 0.05, 0.05: sd 0, p 0) and the compare pair plain − grpo (d = 0.04, 0.02 on
    # seeds 0 and 1: mean 0.03, SE 0.01, t = 3 with 1 df: P(|T| <= 3) = 2 atan(3) / pi = 0.79517, p = 0.20483).
    # Holm, m = 2: 0 < 0.05/2: rejected at 97.5%, adjusted 0; 0.20483 >= 0.05/1: not, at 95%, adjusted 0.20:
    # t(0.975, 1) = 12.7062 x 0.01: [-0.097, +0.157]. Best by mean plain (0.610), runner-up grpo (0.580): no interval.
    assert differences(spec, results) == [
        "", "Primary contrast, final pass@1 (declared in the spec before the runs; runs of one seed share the data "
        "order and the evaluation questions; 95% t interval over seeds):", "",
        "- grpo − exgrpo = +0.020 [−0.005, +0.045] (3 seeds, p 0.074): within noise", "",
        "Other paired differences, Holm-adjusted over these 2 intervals (family-wise 95%: each interval at the level "
        "Holm's step-down tests it at, with its adjusted p):", "", "Final pass@1:", "",
        "- plain − exgrpo = +0.050 [+0.050, +0.050] (2 seeds, Holm: 97.5% interval, adjusted p < 0.001)",
        "- plain − grpo = +0.030 [−0.097, +0.157] (2 seeds, Holm: 95% interval, adjusted p 0.2): within noise", "",
        "Best by mean final pass@1: plain (0.610), runner-up grpo (0.580); descriptive only: the pair is chosen after "
        "ranking, so no interval"]
    text = table(spec, results)
    # the evaluation's SE: root mean square over the runs that logged it, sqrt((0.006^2 + 0.008^2) / 2) = 0.00707
    assert "| exgrpo | 3 | 0.560 ± 0.010 | 0.007 |" in text
    assert "| plain | 2 (1 failed) | 0.610 ± 0.014 | — |" in text
    # --variants leaving the primary's pair out: said, and every interval is Holm-adjusted
    lines = differences(select_variants(spec, ["exgrpo", "plain"]), results)
    assert lines[1] == "No primary contrast among the variants run (the spec's: grpo − exgrpo): every interval below " \
                       "is Holm-adjusted."
    with pytest.raises(SpecError, match=r"reference: 'ppo' is not a variant \(variants: a\)"):
        load_spec(write(tmp_path, dict(name="t", budget_rollouts=10, seeds=[0], variants={"a": {}}, reference="ppo")))
    with pytest.raises(SpecError, match=r"primary: name the one contrast the experiment is for, before it runs: "
                                        r"primary: \[a, b\]"):
        load_spec(write(tmp_path, dict(name="t", budget_rollouts=10, seeds=[0], variants={"a": {}, "b": {}})))
    with pytest.raises(SpecError, match=r"primary: 'ppo': not a variant \(variants: a, b\)"):
        load_spec(write(tmp_path, dict(name="t", budget_rollouts=10, seeds=[0], variants={"a": {}, "b": {}},
                                       primary=["a", "ppo"])))
    # where reasoning is checked, the validity differences join the family (6 in all). Held-out: grpo − exgrpo
    # d = 0.05 x 3 (p ~ 0), plain − exgrpo d = 0.10, 0.09 (seed 2 failed: mean 0.095, SE 0.005, t = 19 with 1 df,
    # p = 1 − 2 atan(19) / pi = 0.03348), plain − grpo d = 0.05, 0.04 (t = 9: p = 0.07045); o*: plain − exgrpo
    # d = −0.12, −0.14 (SE 0.01, t = 13: p = 0.04887). Ascending: ~0, ~0, 0.03348, 0.04887, 0.07045, 0.20483 (pass@1
    # plain − grpo): the two ~0 rejected (at 1 − 0.05/6 and 1 − 0.05/5), 0.03348 >= 0.05/4 stops the step-down: it
    # and the rest at 1 − 0.0125 = 98.75%, where t(0.99375, 1) = 1 / tan(0.00625 pi) = 50.923: plain − exgrpo held-out
    # 0.095 ± 50.923 x 0.005 = [−0.160, +0.350], o* −0.130 ± 0.509. Adjusted: 4 x 0.03348 = 0.134, then
    # max(0.134, 3 x 0.04887 = 0.147) = 0.147, max(0.147, 2 x 0.07045) = 0.147, max(0.147, 0.205) = 0.205
    for r, heldout, chosen in zip(results, [0.80, 0.81, 0.82, 0.85, 0.86, 0.87, 0.9, 0.9, 0.9],
                                  [0.80, 0.81, 0.82, math.nan, math.nan, math.nan, 0.68, 0.67, 0.0]):
        r.mechanism = {"valid_heldout": heldout, "valid_chosen": chosen}
    lines = differences(spec, results)
    assert "Other paired differences, Holm-adjusted over these 6 intervals" in lines[5]
    assert lines[lines.index("Final pass@1:") + 3] == \
        "- plain − grpo = +0.030 [−0.479, +0.539] (2 seeds, Holm: 98.75% interval, adjusted p 0.2): within noise"
    assert lines[lines.index("Held-out valid given correct:") + 3:][:2] == [
        "- plain − exgrpo = +0.095 [−0.160, +0.350] (2 seeds, Holm: 98.75% interval, adjusted p 0.13): within noise",
        "- plain − grpo = +0.045 [−0.210, +0.300] (2 seeds, Holm: 98.75% interval, adjusted p 0.15): within noise"]
    assert lines[lines.index("o* valid:") + 2] == \
        "- plain − exgrpo = −0.130 [−0.639, +0.379] (2 seeds, Holm: 98.75% interval, adjusted p 0.15): within noise"


def test_runs_interleave_seed_by_seed_in_a_shuffled_order_fixed_by_the_seed(tmp_path):
    spec = load_spec(write(tmp_path, dict(name="t", budget_rollouts=10, seeds=[0, 1, 2, 3], primary=["a", "b"],
                                          variants={v: {} for v in "abcd"})))
    order = run_order(spec)
    # seed by seed: the first 4 runs are seed 0's, each variant once; the order within a seed is random.Random(seed)'s
    # shuffle of the spec's order, the same on every call
    assert [s for _, s in order] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    for seed in range(4):
        block = [v for v, s in order if s == seed]
        expect = list("abcd")
        import random
        random.Random(seed).shuffle(expect)
        assert block == expect and sorted(block) == list("abcd")
    assert run_order(spec) == order
    assert len({tuple(v for v, s in order if s == seed) for seed in range(4)}) > 1  # not one fixed variant order


def test_a_run_made_by_other_product_code_is_not_reused(tmp_path):
    now = code_version()
    assert len(now["source"]) == 32 and (now["commit"] is None or len(now["commit"]) == 40)
    assert code_changed(now, now) is None and code_changed(dict(now), code_version()) is None  # deterministic
    older = {"source": "0" * 32, "commit": "a" * 40, "dirty": True}
    said = code_changed(older, {**now, "commit": "b" * 40, "dirty": False})
    assert said == f"made by other product code (commit aaaaaaaaaaaa with uncommitted changes, now commit bbbbbbbbbbbb)"
    assert code_changed({"source": "1" * 32, "commit": None}, {"source": "2" * 32, "commit": None}) == \
        "made by other product code (source 111111111111, now source 222222222222)"
    assert code_changed(None, now) == ("it records no product code version (made before the record, or a changing "
                                       "checkout)")
    # a product file's content is in the hash; a copy of the tree with one byte changed hashes differently
    import shutil
    for pkg in ("actors", "buffer", "cluster", "common", "learner"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    copy = code_version(tmp_path)
    assert copy["source"] == now["source"] and copy["commit"] is None  # no git there: the hash alone
    (tmp_path / "buffer" / "core.py").write_text((tmp_path / "buffer" / "core.py").read_text() + "\n")
    assert code_version(tmp_path)["source"] != now["source"]
    (tmp_path / "cluster" / "experiment_results.py").write_text("# the report only reads runs back\n")
    (tmp_path / "buffer" / "core.py").write_text((ROOT / "buffer" / "core.py").read_text())
    assert code_version(tmp_path)["source"] == now["source"]


def test_the_paper_preset_and_grpo_s_clip(tmp_path):
    spec = load_spec("small_set")
    assert spec.primary == ("exgrpo", "grpo") and len(spec.seeds) == 6 and "exgrpo_async" in spec.variants
    ex, grpo = variant_overrides(spec, "exgrpo"), variant_overrides(spec, "grpo")
    for key in ("buffer.max_lag=0", "learner.batching.mini_batches=2", "learner.loss.recompute_old_logprobs=true",
                "buffer.mixed_switch_accuracy=0.35"):
        assert key in ex and key in grpo, key
    assert "learner.loss.clip_fresh=auto" in ex and "learner.loss.clip_fresh=true" in grpo
    assert variant_overrides(spec, "exgrpo_async") == overrides(spec.base)  # the project's defaults
    for path in sorted(BUNDLED.glob("*.yaml")):  # every bundled spec: a primary contrast, a fixed seed count
        s = load_spec(path.stem)
        assert s.primary and len(s.seeds) >= 3, path
    from common.config import ConfigError, load_config
    cfg = load_config(None, ex)
    assert cfg.buffer.max_lag == 0 and cfg.learner.loss.clip_fresh == "auto" and cfg.learner.loss.stores_learner_logprobs
    # GRPO's buffer switches mixed mode on too: clip_fresh=auto would unclip it with nothing replayed: refused
    with pytest.raises(ConfigError, match="learner.loss.clip_fresh: auto unclips fresh tokens once mixed mode starts"):
        load_config(None, [*overrides(PRESETS["grpo_paper"]), "learner.loss.clip_fresh=auto"])
    with pytest.raises(SpecError, match=r"variants: a: preset: 'paper': not a preset \(presets: exgrpo_paper, "):
        load_spec(write(tmp_path, dict(name="t", budget_rollouts=10, seeds=[0], variants={"a": {"preset": "paper"}})))


# ------------------------------------------------------------------------------ what the experiment owns


def test_a_variant_or_base_that_sets_what_the_experiment_sets_is_refused(tmp_path):
    spec = dict(name="t", budget_rollouts=10, seeds=[0], base={"seed": 3, "tracking": {"enabled": False}},
                primary=["a", "b"], variants={"a": {"name": "mine", "total_rollouts": 5},
                                              "b": {"checkpoint": {"runs_root": "/x"}, "tracking.uri": "sqlite:///y.db"},
                                              "c": {"learner.seed": 1}})
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, spec))
    assert e.value.lines == [
        "base: seed: set by the experiment (set from the spec's `seeds` list, with buffer.seed, learner.seed, "
        "generator.seed and data.seed)",
        "variants.a: name: set by the experiment (each run is named <spec name>-<variant>-s<seed>: set the spec's "
        "`name`)",
        "variants.a: total_rollouts: set by the experiment (every run's budget: set the spec's `budget_rollouts`)",
        "variants.b: checkpoint.runs_root: set by the experiment (the runs go under `exgrpo experiment --runs-root "
        "DIR`)",
        "variants.c: learner.seed: set by the experiment (set from the spec's `seeds` list, with seed)",
        "variants.b: tracking.uri: every run of an experiment logs to one MLflow store, which the experiment reads "
        "its results from: set tracking.uri in the spec's base",
        "base: tracking.enabled: false: an experiment reads every run's results back from MLflow; leave tracking on "
        "(tracking.uri in the base picks the store)"]


def test_a_yaml_boolean_where_a_name_belongs_says_to_quote_it(tmp_path):
    (tmp_path / "s.yaml").write_text("name: on\nbudget_rollouts: 10\nseeds: [0]\nvariants: {a: {}}\n")
    with pytest.raises(SpecError) as e:
        load_spec(str(tmp_path / "s.yaml"))
    assert e.value.lines == ["name: YAML read this as the boolean true (unquoted on, off, yes, no, true and false "
                             "are booleans); quote it, e.g. name: 'on'"]


def test_a_runs_root_that_is_a_file_is_refused_before_anything_runs(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert runs_root_problem(f) == f"--runs-root: {f} is a file, not a folder; point --runs-root at a folder"
    assert runs_root_problem(f / "sub") == f"--runs-root: {f} is a file, not a folder; point --runs-root at a folder"
    assert runs_root_problem(tmp_path / "new" / "runs") is None and not (tmp_path / "new").exists()
    p = subprocess.run([sys.executable, "-m", "cluster.cli", "experiment", "ablations", "--runs-root", str(f)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip() == f"exgrpo experiment: --runs-root: {f} is a file, not a folder; point --runs-root at " \
                               "a folder"


def test_a_tracking_password_goes_to_the_runs_environment_not_their_command_lines(monkeypatch):
    """A command line is visible to every user of the machine: the run gets tracking.uri redacted and its password
    in MLFLOW_TRACKING_PASSWORD, from which `exgrpo train` reads it back."""
    from cluster.experiment import ExperimentSpec, password_to_env, train_command
    from common.config import load_config, restore_secrets

    spec = ExperimentSpec(name="x", budget_rollouts=8, seeds=[0], variants={"a": {}},
                          base={"tracking.uri": "http://alice:PASSWORD@127.0.0.1:9/"})
    cmd, env = password_to_env(train_command(spec, "a", 0, Path("runs"), "parent-id"))
    assert "tracking.uri=http://alice:***@127.0.0.1:9/" in cmd and "PASSWORD" not in " ".join(cmd)
    assert env["MLFLOW_TRACKING_PASSWORD"] == "PASSWORD"
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", env["MLFLOW_TRACKING_PASSWORD"])
    cfg = restore_secrets(load_config(None, [a for a in cmd if "=" in a]))
    assert cfg.tracking.uri == "http://alice:PASSWORD@127.0.0.1:9/"


def test_sigterm_stops_the_run_in_flight_with_a_checkpoint_and_marks_the_experiment_killed(tmp_path, joined):
    """A job scheduler's stop: SIGTERM to `exgrpo experiment` reaches its `exgrpo train` run, which stops after its
    step with a checkpoint; the second run never starts; the parent MLflow run is KILLED and the command says how to
    go on (exit 0, as a stopped `exgrpo train`). Before, the run in flight went on to its end as an orphan."""
    import signal

    from tests.cluster.runs import wait_for

    spec = dict(name="stop", budget_rollouts=100_000, seeds=[0], primary=["a", "b"],
                base={"total_steps": 1000, "checkpoint.every_steps": 0, "generator.engine.kind": "transformers",
                      "cluster.address": joined.address},
                variants={"a": {}, "b": {"buffer.replay_ratio": 0, "buffer.collect": False}})
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "cluster.cli", "experiment", write(tmp_path, spec), "--runs-root", str(runs)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=joined.env)
    try:
        wait_for(lambda: any("step 1/" in f.read_text() for f in runs.glob("stop/logs/*.log")) or p.poll() is not None,
                 600, "the first run's first step")
        assert p.poll() is None, p.communicate()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    assert "stopped by SIGTERM: 0 of 2 runs had finished, the runs in flight stopped with a checkpoint; the same " \
           "command again reuses the finished runs" in err, err[-3000:]
    (log,) = [f for f in runs.glob("stop/logs/*.log")]  # the second run never started
    from tests.cluster.runs import state

    s = state(runs / log.stem)
    assert s["status"] == "KILLED" and s["checkpoints"], s
    assert "SIGTERM: stopping after the current step, with a checkpoint" in log.read_text()
    client = mlflow_client(runs)
    (parent,) = [r for r in client.search_runs([client.get_experiment_by_name("exgrpo").experiment_id])
                 if r.info.run_name == "stop"]
    assert parent.info.status == "KILLED"
