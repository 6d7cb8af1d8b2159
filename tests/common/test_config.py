"""Config validation: readable "field: problem" lines, exit code 2 from the CLI, YAML round trip."""

from __future__ import annotations

import pytest

from cluster.cli import main
from common.config import ConfigError, RunConfig, load_config, to_yaml


def _lines(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    return e.value.lines


def test_defaults_are_valid_and_round_trip_through_yaml(tmp_path):
    cfg = load_config()
    assert cfg.data.task == "countdown" and cfg.reward.name == "countdown"
    p = tmp_path / "c.yaml"
    p.write_text(to_yaml(cfg))
    assert load_config(p) == cfg


def test_overrides_are_parsed_as_yaml_values():
    cfg = load_config(None, ["buffer.group_size=4", "learner.loss.shaping_beta=null", "generator.stop=[a, b]"])
    assert cfg.buffer.group_size == 4 and cfg.learner.loss.shaping_beta is None and cfg.generator.stop == ["a", "b"]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("buffer.group_size=1", "buffer.group_size: Input should be greater than or equal to 2"),
        ("buffer.grup_size=8", "buffer.grup_size: unknown field"),
        ("reward.timeout_s=abc", "reward.timeout_s: Input should be a valid number"),
        ("model.toy.num_heads=4", "hidden_size / num_heads = 96/4 must be 32, 64 or 128"),
        ("learner.batching.mini_batches=3", "learner.batching.mini_batches: 3 does not divide buffer.batch_questions 16"),
        ("reward.name=arithmetic",
         "reward.name: arithmetic cannot score the countdown task; set reward.name=countdown"),
        ("nonsense", "nonsense: an override is written key=value"),
        ("buffer.group_size.x=1", "buffer.group_size.x: group_size is a value, not a section"),
        ("learner.levers.attn_implementation=flash2", "learner.levers.attn_implementation: 'flash2' is not an "
                                                "attention implementation transformers knows: use one of sdpa"),
    ],
)
def test_invalid_values_give_field_problem_lines(override, expected):
    lines = _lines([override])
    assert any(expected in line for line in lines), lines


def test_override_below_a_value_is_refused():
    assert _lines(["buffer.group_size=4", "buffer.group_size.x=1"]) == [
        "buffer.group_size.x: group_size is a value, not a section"]


def test_several_problems_are_all_reported():
    lines = _lines(["buffer.group_size=0", "reward.correct_threshold=2"])
    assert len(lines) == 2
    assert sorted(line.split(":")[0] for line in lines) == ["buffer.group_size", "reward.correct_threshold"]


def test_consistency_problems_are_one_line_each():
    lines = _lines(["cluster.autoscale.min_generators=5", "cluster.autoscale.max_generators=2",
                    "generator.num_generators=0"])
    assert "cluster.autoscale.min_generators: 5 exceeds max_generators 2" in lines
    assert any(line.startswith("generator.num_generators: 0 generators") for line in lines)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_config(bad)


def test_every_field_has_a_docstring():
    missing = []

    def walk(model, prefix):
        for name, info in model.model_fields.items():
            if name != "kind" and not info.description:
                missing.append(prefix + name)
            ann = info.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann, f"{prefix}{name}.")

    walk(RunConfig, "")
    assert not [m for m in missing if m.count(".") >= 1], missing


def test_cli_invalid_config_exits_2_with_lines_and_no_traceback(capsys):
    with pytest.raises(SystemExit) as e:
        main(["config", "buffer.group_size=1", "reward.nme=x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid configuration:" in err
    assert "  buffer.group_size: Input should be greater than or equal to 2" in err
    assert "  reward.nme: unknown field" in err
    assert "Traceback" not in err


def test_cli_missing_config_file_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["config", str(tmp_path / "missing.yaml")])
    assert e.value.code == 2
    assert "config file not found" in capsys.readouterr().err


def test_resume_keeps_the_kind_of_a_union_section_whose_fields_changed():
    """A resolved engine setting (max_model_len, fitted at start) under the default engine kind: the resumed
    config still knows which kind it is (the saved file holds it; the overrides are applied on top)."""
    from common.config import resume_config

    cfg = load_config(None, ["data.task=arithmetic"])
    engine = cfg.generator.engine.model_copy(update={"vllm": cfg.generator.engine.vllm.model_copy(
        update={"max_model_len": 1048})})
    cfg = cfg.model_copy(update={"generator": cfg.generator.model_copy(update={"engine": engine})})
    new, changes = resume_config(load_config_text(to_yaml(cfg)), ["total_steps=100"])
    assert changes == {"total_steps": (cfg.total_steps, 100)}
    assert new.generator.engine.kind == "auto" and new.generator.engine.vllm.max_model_len == 1048


def load_config_text(text: str):
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "config.yaml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize("attn, padding_free, packs", [
    (None, "auto", False), ("sdpa", "auto", False), ("flash_attention_2", "auto", True),
    ("kernels-community/flash-attn2", "auto", True), ("sdpa", True, True), ("flash_attention_3", False, False)])
def test_padding_free_auto_follows_the_attention(attn, padding_free, packs):
    cfg = load_config(None, [f"learner.levers.attn_implementation={attn or 'null'}", f"learner.levers.padding_free={padding_free}"])
    assert cfg.learner.levers.packs_padding_free is packs


# ------------------------------------------------------------- accepted without a word before (issue 51, part B)


@pytest.mark.parametrize("overrides, expected", [
    (["data.question_field=answer"], "data.question_field and data.answer_field both name 'answer': every prompt would "
                                     "be its own reference answer"),
    (["data.id_field=question"], "data.id_field and data.question_field both name 'question': rows with the same "
                                 "question would be skipped as duplicate ids"),
    (["learner.lora.rank=8", "learner.weight_sync.delta=true"],
     "learner.weight_sync.delta=true applies to merged publications only, and learner.lora.publish=adapters sends the "
     "adapters whole: set learner.weight_sync.delta=false, or learner.lora.publish=merged"),
    (["learner.lora=true"], "learner.lora: a section that is off by default (null), not true: setting any of its "
                            "fields turns it on, e.g. learner.lora.rank=8"),
    (["learner.lora=false"], "learner.lora: a section that is off by default (null), not false: learner.lora=null "
                             "turns it off"),
    # before: every in-run evaluation failed at run time ("in-run evaluation failed (N so far; training goes on)")
    (["eval.every_steps=3", "learner.weight_sync.kind=collective"],
     "eval.every_steps: the in-run evaluator reads each version from Ray's object store, which "
     "learner.weight_sync.kind=collective leaves empty"),
])
def test_settings_that_would_be_silently_wrong_are_refused(overrides, expected):
    lines = _lines(overrides)
    assert len(lines) == 1 and expected in lines[0], lines


def test_lora_with_merged_publications_keeps_delta_and_the_fields_stay_apart():
    cfg = load_config(None, ["learner.lora.rank=8", "learner.lora.publish=merged", "learner.weight_sync.delta=true"])
    assert cfg.learner.weight_sync.delta and cfg.learner.lora.publish == "merged"
    assert load_config(None, ["data.question_field=problem", "data.id_field=null"]).data.id_field is None


@pytest.mark.parametrize("argv, meant", [
    (["buffer.group_size:8"], "overrides are written key=value: did you mean buffer.group_size=8?"),
    (["buffer.group_size:", "8"], "overrides are written key=value: did you mean buffer.group_size=8?"),
    (["total_steps=3", "buffer.group_size:8"], "did you mean buffer.group_size=8?"),
    (["--buffer.group_size=8"], "--buffer.group_size=8: overrides are written key=value, without dashes: did you "
                                "mean buffer.group_size=8?"),
    (["--total_steps", "5"], "--total_steps: overrides are written key=value, without dashes: did you mean "
                             "total_steps=5?"),
])
def test_overrides_in_yaml_or_option_form_are_answered_with_the_key_value_form(capsys, argv, meant):
    with pytest.raises(SystemExit) as e:
        main(["config", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and meant in err and "config file not found" not in err, err
