"""`exgrpo experiment`: spec checks (fast) and a short real experiment (two variants, one seed,
a two-step rollout budget) that writes its table, plot and nested MLflow runs. It never asserts
which variant wins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.cli import main
from cluster.experiment import BUNDLED, SpecError, load_spec, overrides, select_variants
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
    assert overrides({"learner.shaping_beta": None, "buffer.replay_ratio": 0.25}) == [
        "learner.shaping_beta=null", "buffer.replay_ratio=0.25"]
    base = dict(name="t", budget_rollouts=10, seeds=[0], variants={"a": {}})
    with pytest.raises(SpecError, match=r"variants.b: buffer.grup_size: unknown field"):
        load_spec(write(tmp_path, {**base, "variants": {"a": {}, "b": {"buffer.grup_size": 3}}}))
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


@pytest.mark.slow
def test_a_short_experiment_writes_its_table_plot_and_nested_runs(tmp_path, capsys, joined):
    spec = dict(name="mini", budget_rollouts=256, seeds=[0],
                base={"total_steps": 50, "checkpoint.every_steps": 0, "eval.every_steps": 1, "eval.questions": 16,
                      "eval.samples": 2, "generator.engine.kind": "transformers", "cluster.address": joined.address},
                variants={"exgrpo": {}, "grpo": {"buffer.replay_ratio": 0, "buffer.collect": False,
                                                 "learner.policy_loss": "cispo"}})
    runs = tmp_path / "runs"
    spec_file = write(tmp_path, spec)
    cmd = [sys.executable, "-m", "cluster.cli", "experiment", spec_file, "--runs-root", str(runs)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=joined.env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results, rest = out.stdout.split("What the buffer did")
    mechanism, costs = rest.split("What it cost")
    costs, loss = costs.split("What the policy loss did")  # a variant sets learner.policy_loss: the loss's table
    rows = [line for line in results.splitlines() if line.startswith(("| exgrpo", "| grpo"))]
    assert len(rows) == 2 and all("| 1 |" in r for r in rows), out.stdout
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

    client = mlflow_client(runs)
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
                                        r"base, variants, run_timeout_s \(name, budget_rollouts, seeds, variants "
                                        r"required; cluster/experiments/ablations.yaml is one\)"):
        load_spec(str(tmp_path / "empty.yaml"))
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, dict(name="t", budget_rollouts=10, seeds=[0], variant={"a": {}})))
    assert e.value.lines == ["variants: missing: Variant name -> its overrides ({} = the defaults).",
                             "variant: unknown field; did you mean variants?"]


def test_experiment_help_lists_the_bundled_specs_and_the_defaults():
    p = subprocess.run([sys.executable, "-m", "cluster.cli", "experiment", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    text = " ".join(p.stdout.split())
    assert p.returncode == 0 and "(default: runs)" in text and "(default: 1)" in text, p.stdout
    assert all(f.stem in text for f in BUNDLED.glob("*.yaml")), p.stdout
