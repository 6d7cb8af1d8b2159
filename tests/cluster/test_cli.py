"""CLI: config printing, readable config errors with exit code 2, generated docs up to date."""

from __future__ import annotations

import json

from pathlib import Path

import pytest
import yaml

from cluster.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_config_prints_resolved_yaml_with_overrides(capsys, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("buffer:\n  group_size: 4\n")
    assert main(["config", str(f), "buffer.max_lag=0", "learner.optim.lr=1e-5"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["buffer"]["group_size"] == 4 and out["buffer"]["max_lag"] == 0 and out["learner"]["optim"]["lr"] == 1e-5


@pytest.mark.parametrize(
    "args, expected",
    [
        (["buffer.group_size=1"], "buffer.group_size: Input should be greater than or equal to 2"),
        (["buffer.grup_size=4"], "buffer.grup_size: unknown field"),
        (["learner.batching.mini_batches=3"], "learner.batching.mini_batches: 3 does not divide buffer.batch_questions 16"),
        (["generator.engine.kind=tpu"], "generator.engine"),
        (["=3"], "=3: an override is written key=value"),
        (["buffer.replay_ratio=abc"], "buffer.replay_ratio: Input should be a valid number"),
    ],
)
def test_invalid_config_gives_field_problem_lines_and_exit_2(capsys, args, expected):
    with pytest.raises(SystemExit) as e:
        main(["config", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("invalid configuration:")
    assert expected in err
    assert "Traceback" not in err


def test_train_with_missing_model_folder_exits_2(capsys, tmp_path):
    code = main(["train", f"model.path={tmp_path / 'no-model'}", f"checkpoint.runs_root={tmp_path}", "name=x",
                 "tracking.enabled=false"])
    assert code == 2
    assert "model.path:" in capsys.readouterr().err


def test_configuration_docs_are_generated_from_the_models():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py")], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    assert (ROOT / "docs" / "configuration.md").read_text() == out, (
        "docs/configuration.md is stale: run `python scripts/gen_config_docs.py > docs/configuration.md`")


def test_eval_prints_a_table_for_a_model_folder(capsys, tiny_model_dir, tmp_path):
    code = main(["eval", "--model", str(tiny_model_dir), "--task", "arithmetic", "--limit", "6", "--samples", "2",
                 "generator.engine.kind=transformers", "tracking.enabled=false", f"checkpoint.runs_root={tmp_path}"])
    assert code == 0
    out = capsys.readouterr().out
    assert "greedy accuracy" in out and "pass@2" in out and "questions                       6" not in out
    assert any(line.split()[:1] == ["questions"] and line.split()[-1] == "6" for line in out.splitlines())
    # without --samples: eval.samples and eval.temperature, as the in-run evaluator (issue 45: it was a fixed 8, 0.6)
    code = main(["eval", "--model", str(tiny_model_dir), "--task", "arithmetic", "--limit", "3", "eval.samples=3",
                 "eval.temperature=1.0", "generator.engine.kind=transformers", "tracking.enabled=false",
                 f"checkpoint.runs_root={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0 and "pass@3" in out and "T=1.0, 3 samples" in out, out


def test_eval_reports_every_eval_set_with_its_own_reward_and_samples(capsys, tiny_model_dir, tmp_path):
    from common.tasks import get_task
    from tests.cluster.runs import mlflow_client

    _, test = get_task("arithmetic").generate(0, 50, 10)
    path = tmp_path / "arith.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in test))
    code = main(["eval", "--model", str(tiny_model_dir), "generator.engine.kind=transformers",
                 f"checkpoint.runs_root={tmp_path}", f"eval.sets.arith.path={path}", "eval.sets.arith.reward=arithmetic",
                 "eval.sets.arith.samples=2", f"eval.sets.exact.path={path}", "eval.sets.exact.reward=exact",
                 "eval.sets.exact.samples=3", "eval.sets.exact.questions=4"])
    assert code == 0
    out = capsys.readouterr().out
    sets = [line.split() for line in out.splitlines() if line.startswith("set ")]
    assert sets == [["set", "arith"], ["set", "exact"]], out
    assert "pass@2" in out and "pass@3" in out and "mean response length" in out
    client = mlflow_client(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("exgrpo").experiment_id])
    m = run.data.metrics
    assert {"eval/arith/pass_at_2", "eval/arith/mean_at_2", "eval/exact/pass_at_3", "eval/exact/response_length_mean"} \
        <= set(m)
    assert m["eval/arith/questions"] == 10 and m["eval/exact/questions"] == 4


def test_eval_with_missing_model_folder_exits_2(capsys, tmp_path):
    assert main(["eval", "--model", str(tmp_path / "nope")]) == 2
    assert "not a Hugging Face model folder" in capsys.readouterr().err


def test_scale_without_a_running_job_is_a_clear_error(capsys, tmp_path):
    code = main(["scale", "--run", "nope", "--generators", "2", "--runs-root", str(tmp_path),
                 "--address", "127.0.0.1:1"])
    assert code == 2
    assert "cannot reach the Ray cluster" in capsys.readouterr().err


def test_resume_of_a_folder_that_is_not_a_run_exits_2(capsys, tmp_path):
    assert main(["train", "--resume", str(tmp_path / "nope")]) == 2
    assert "is not a run folder" in capsys.readouterr().err


def test_version_prints_the_installed_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"exgrpo {version('exgrpo')}"


def test_extend_context_copies_a_model_folder_with_longer_positions(capsys, tiny_model_dir, tmp_path):
    """`exgrpo extend-context` (issue 51): only config.json changes; the other files are linked (or copied with
    --copy); a destination that exists, or a source that is not a model folder, is refused with what to change."""
    src = json.loads((tiny_model_dir / "config.json").read_text())
    dst = tmp_path / "long"
    assert main(["extend-context", str(tiny_model_dir), str(dst), "--max-positions", "2048", "--rope-theta", "40000"]) == 0
    assert f"wrote {dst}: config.json max_position_embeddings {src['max_position_embeddings']} -> 2048" in \
        capsys.readouterr().out
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 2048 and cfg["rope_theta"] == 40000
    if isinstance(cfg.get("rope_parameters"), dict):  # transformers 5 keeps the base there too
        assert cfg["rope_parameters"]["rope_theta"] == 40000
    assert {k: v for k, v in cfg.items() if k not in ("max_position_embeddings", "rope_theta", "rope_parameters")} == \
        {k: v for k, v in src.items() if k not in ("max_position_embeddings", "rope_theta", "rope_parameters")}
    linked = sorted(p.name for p in dst.iterdir() if p.is_symlink())
    assert linked == sorted(p.name for p in tiny_model_dir.iterdir() if p.name != "config.json")

    copied = tmp_path / "copied"
    assert main(["extend-context", str(tiny_model_dir), str(copied), "--max-positions", "1024", "--copy"]) == 0
    assert not any(p.is_symlink() for p in copied.iterdir())
    capsys.readouterr()
    assert main(["extend-context", str(tiny_model_dir), str(dst), "--max-positions", "2048"]) == 2
    assert f"DST: {dst} exists; name a new folder" in capsys.readouterr().err
    assert main(["extend-context", str(tmp_path / "nope"), str(tmp_path / "x"), "--max-positions", "2048"]) == 2
    assert "SRC: " in capsys.readouterr().err and not (tmp_path / "x").exists()
    n = src["max_position_embeddings"]
    assert main(["extend-context", str(tiny_model_dir), str(tmp_path / "x"), "--max-positions", str(n // 2)]) == 2
    assert f"--max-positions {n // 2} is not above the model's {n} positions" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit):
        main(["extend-context", str(tiny_model_dir), str(tmp_path / "y"), "--max-positions", "2048", "--rope-theta", "-1"])
