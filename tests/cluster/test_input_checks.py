"""Inputs that were accepted without a word, or refused only inside an actor (issue 51, part B): each is now
refused by `exgrpo config` and by `exgrpo train` before Ray starts (nothing created), with the numbers and the
file that disagree. No Ray is started (`cluster.input_checks`, hooked into `cluster.preflight.input_problems`)."""

from __future__ import annotations

import http.server
import json
import logging
import shutil
import socket
import threading
from pathlib import Path

import pytest
import yaml

from cluster.experiment import SpecError, check_inputs, load_spec
from cluster.input_checks import cluster_address_problem, embedding_rows, model_problems
from tests.cluster.test_bad_input import assert_refused, cli


@pytest.fixture(autouse=True)
def _no_console_of_an_earlier_train():
    """The console handler an in-process `exgrpo train` installs (cluster.console.setup_logging) keeps the sys.stderr
    of the test that ran it, closed by the next test: removed, as a fresh `exgrpo` process has none."""
    def remove() -> None:
        root = logging.getLogger()
        for h in [h for h in root.handlers if type(h) is logging.StreamHandler]:
            root.removeHandler(h)

    remove()
    yield
    remove()


def _copy(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    if config:
        (dst / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **config}))
    return dst


def _config_and_train(capsys, tmp_path: Path, *overrides: str, expected: str) -> None:
    """`exgrpo config` and `exgrpo train` both refuse with `expected`; train leaves no run folder."""
    assert_refused(*cli(capsys, "config", *overrides), expected)
    runs = tmp_path / "runs"
    code, out = cli(capsys, "train", f"checkpoint.runs_root={runs}", "tracking.enabled=false", "name=r", *overrides)
    assert_refused(code, out, "invalid configuration:", expected)
    assert not (runs / "r").exists()


def test_a_config_vocab_size_the_weights_do_not_hold_is_refused_naming_both(capsys, tmp_path, tiny_model_dir):
    rows = embedding_rows(tiny_model_dir)
    assert rows is not None and rows[:2] == ("model.embed_tokens.weight", 99)  # read from the header alone
    model = _copy(tiny_model_dir, tmp_path / "model", vocab_size=163)
    _config_and_train(capsys, tmp_path, f"model.path={model}",
                      expected=f"model.path: {model / 'config.json'} says vocab_size 163, but the weights hold 99 rows "
                               "in model.embed_tokens.weight (model.safetensors)")


def test_the_embedding_rows_are_read_from_a_sharded_checkpoint_s_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(7, 2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"lm_head.weight": torch.zeros(7, 2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    assert embedding_rows(tmp_path) == ("model.embed_tokens.weight", 7, tmp_path / "model-00001-of-00002.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    assert model_problems(tmp_path) == [  # no tokenizer here: that check is model_folder_problem's
        f"model.path: {tmp_path / 'config.json'} says vocab_size 8, but the weights hold 7 rows in "
        "model.embed_tokens.weight (model-00001-of-00002.safetensors); the config and the weights come from different "
        "models: set vocab_size to 7 in config.json, or copy the config.json that came with these weights"]


def test_a_tokenizer_with_ids_beyond_the_vocabulary_is_refused_naming_both(capsys, tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    model = _copy(tiny_model_dir, tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_tokens(["<extra_a>", "<extra_b>"])  # ids 99 and 100: the embedding has rows 0..98
    tok.save_pretrained(model)
    _config_and_train(capsys, tmp_path, f"model.path={model}",
                      expected=f"model.path: the tokenizer in {model} has token ids up to 100, but config.json's "
                               "vocab_size is 99 (the embedding has rows 0..98)")
    assert model_problems(tiny_model_dir) == []  # the folder as made agrees with itself


def test_lora_targets_that_match_no_linear_are_refused_with_the_model_s_names(capsys, tmp_path, tiny_model_dir):
    _config_and_train(capsys, tmp_path, f"model.path={tiny_model_dir}", "learner.lora.target_modules=[no_such_proj]",
                      expected="learner.lora.target_modules: no_such_proj match no Linear of this model; its Linear "
                               "modules are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj")
    code, out = cli(capsys, "config", f"model.path={tiny_model_dir}", "learner.lora.target_modules=[q_proj, v_proj]")
    assert code == 0, out


def test_an_unreachable_cluster_address_is_one_line_before_ray(capsys, tmp_path):
    closed = socket.socket()  # bound, never listening: a connect is refused
    closed.bind(("127.0.0.1", 0))
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    with closed, listening:
        refused = f"127.0.0.1:{closed.getsockname()[1]}"
        assert cluster_address_problem(refused).startswith(f"cluster.address: {refused} could not be reached "
                                                           "(Connection refused); check that the head runs (`ray "
                                                           "start --head` there")
        assert "RAY_AUTH_MODE" in cluster_address_problem(refused)
        assert cluster_address_problem(f"127.0.0.1:{listening.getsockname()[1]}") is None
    assert cluster_address_problem("auto") is None and cluster_address_problem(None) is None
    web = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # another program's port
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        assert cluster_address_problem(f"127.0.0.1:{web.server_port}").startswith(
            f"cluster.address: 127.0.0.1:{web.server_port} answers, but not as a Ray cluster's GCS (UNAVAILABLE: ")
    finally:
        web.shutdown()
    assert "'localhost' has no port" in cluster_address_problem("localhost")
    assert "is not a Ray address" in cluster_address_problem("http://head:6379")
    _config_and_train(capsys, tmp_path, "cluster.address=not-a-host:99999",
                      expected="cluster.address: 'not-a-host:99999': '99999' is not a port (1 to 65535)")
    _config_and_train(capsys, tmp_path, "cluster.address=not-a-host.invalid:6379",
                      expected="cluster.address: not-a-host.invalid:6379: the host 'not-a-host.invalid' does not resolve")


def _spec(tmp_path: Path, **spec) -> str:
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump({"name": "t", "budget_rollouts": 10, "seeds": [0], "variants": {"a": {}}, **spec}))
    return str(p)


def test_an_experiment_checks_every_variant_s_inputs_before_any_run(capsys, tmp_path):
    with pytest.raises(SpecError, match=r"seeds: \[0, 0\]: each seed once .* e.g. seeds: \[0, 1\]"):
        load_spec(_spec(tmp_path, seeds=[0, 0]))
    spec = load_spec(_spec(tmp_path, variants={"ok": {}, "nomodel": {"model.path": str(tmp_path / "nope")},
                                               "noreward": {"reward.name": "nosuchmod:score"}}, primary=["ok", "nomodel"]))
    with pytest.raises(SpecError) as e:
        check_inputs(spec)
    assert [line.split(" (")[0] for line in e.value.lines] == [
        f"variants.nomodel: model.path: {tmp_path / 'nope'} does not exist, so it is not a Hugging Face model folder",
        "variants.noreward: reward.name: cannot import module 'nosuchmod'"]
    runs = tmp_path / "runs"
    assert_refused(*cli(capsys, "experiment", _spec(tmp_path, variants={"nomodel": {"model.path": "/nope"}}),
                        "--runs-root", runs), "invalid experiment spec:", "variants.nomodel: model.path: /nope")
    assert not runs.exists()  # no run, no MLflow store, no results folder


@pytest.mark.parametrize("content, expected", [
    (json.dumps([{"question": "1 2 -> 3", "answer": "3"}] * 2, indent=1),
     "a JSON array of 2 items, not JSON Lines; JSON Lines is one object per line; convert it with python -c"),
    ('{"question": "caf\xe9", "answer": "1"}\n', "not UTF-8 text (byte 0xe9 at column 18): the file has another "
                                                  "encoding (latin-1?); re-save it as UTF-8"),
])
def test_data_that_is_not_json_lines_says_what_it_is(capsys, tmp_path, tiny_model_dir, content, expected):
    data = tmp_path / "d.json"
    data.write_bytes(content.encode("latin-1"))
    assert_refused(*cli(capsys, "config", f"model.path={tiny_model_dir}", f"data.train_path={data}",
                        "reward.name=exact"), expected)


# ------------------------------------------------------------------------------------------------ at run time


@pytest.mark.slow
def test_a_run_whose_rewards_all_fail_stops_by_default_saying_so(tmp_path, joined):
    """Before: every rollout a reward error, one warning a step, and every update made on zeros (rc 0). Now the
    run stops after reward.stop_after_error_steps (3) steps of nothing but errors, with a checkpoint;
    reward.max_error_fraction (unset here) stays the knob for partial failures."""
    from tests.cluster.runs import run_train, state

    r = run_train(tmp_path, "errors", "reward.name=tests.common.reward_fns:raises", "total_steps=10",
                  "tracking.enabled=false", *joined.overrides, env=joined.env)
    assert r.returncode == 1, r.stdout[-4000:]
    assert "every rollout of the first 3 steps was a reward error scored 0" in r.stdout
    assert "with reward.name=tests.common.reward_fns:raises: the reward function fails on every call; stopping " \
           "instead of training on zeros (reward.stop_after_error_steps=3)" in r.stdout
    assert "(reward error: raised RuntimeError: broken on" in r.stdout  # the error itself, with its sample
    assert "training goes on with those zeros, until 3 steps of nothing else (reward.stop_after_error_steps)" \
        in r.stdout  # the warning of step 1
    assert "step 4/10" not in r.stdout and state(tmp_path / "errors")["checkpoints"][-1].endswith("step-000003")


def test_weights_cut_short_are_refused_before_ray_naming_the_expected_and_actual_size(capsys, tmp_path,
                                                                                      tiny_model_dir):
    """An interrupted download: model.safetensors at half its size passes every other check; its header says how
    long it must be."""
    model = _copy(tiny_model_dir, tmp_path / "model")
    weights = model / "model.safetensors"
    full = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: full // 2])
    _config_and_train(capsys, tmp_path, f"model.path={model}",
                      expected=f"model.path: {weights} is cut short: its header says {full} bytes, the file has "
                               f"{full // 2} (50%): an interrupted download or copy; download or copy it again")


def test_each_shard_of_a_sharded_checkpoint_is_checked_whole(tmp_path):
    import torch
    from safetensors.torch import save_file

    from cluster.input_checks import weights_cut_short

    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    save_file({"model.embed_tokens.weight": torch.zeros(7, 2)}, str(tmp_path / names[0]))
    save_file({"lm_head.weight": torch.zeros(7, 2)}, str(tmp_path / names[1]))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": names[0], "lm_head.weight": names[1], "model.norm.weight": names[2]}}))
    assert weights_cut_short(tmp_path) == [
        f"model.path: model.safetensors.index.json names the shard {names[2]}, which is not in {tmp_path}; download it"]
    save_file({"model.norm.weight": torch.zeros(2)}, str(tmp_path / names[2]))
    assert weights_cut_short(tmp_path) == []
    second = tmp_path / names[1]
    full = second.stat().st_size
    second.write_bytes(second.read_bytes()[:-1])  # one byte short
    assert weights_cut_short(tmp_path, "--model") == [
        f"--model: {second} is cut short: its header says {full} bytes, the file has {full - 1} ({(full - 1) / full:.0%}): an "
        "interrupted download or copy; download or copy it again"]
    second.write_bytes(second.read_bytes()[:20])  # inside the header
    assert weights_cut_short(tmp_path) == [f"model.path: {second} is not a readable safetensors file (its header is "
                                           "cut short or damaged; 20 bytes); download or copy it again"]


def _imports(package: str) -> bool:
    try:
        __import__(package)
    except (ImportError, OSError):
        return False
    return True


@pytest.mark.skipif(_imports("flash_attn"), reason="flash-attn imports here: flash_attention_2 is accepted")
def test_flash_attention_that_does_not_import_is_refused_before_ray_naming_sdpa_and_eager(capsys, tmp_path):
    from learner.levers import attention_problem

    says = ("learner.levers.attn_implementation: flash_attention_2 needs the flash_attn package, which does not import here "
            "(No module named 'flash_attn'); set learner.levers.attn_implementation=sdpa (transformers' default) or eager")
    _config_and_train(capsys, tmp_path, "learner.levers.attn_implementation=flash_attention_2", expected=says)
    assert attention_problem("flash_attention_2").startswith(says)  # what a cluster's learner rank says at its start
    assert attention_problem("sdpa") is None and attention_problem(None) is None
    code, out = cli(capsys, "config", "learner.levers.attn_implementation=flash_attention_2", "cluster.address=auto")
    assert "does not import here" not in out  # on a cluster the learner's node decides


def test_a_batch_larger_than_the_data_and_held_out_sets_that_are_the_training_file_are_said(tmp_path):
    from cluster.preflight import data_notes
    from common.config import load_config

    train = tmp_path / "train.jsonl"
    for f in (train, tmp_path / "test.jsonl"):
        f.write_text('{"question": "1+1", "answer": "2"}\n')
    cfg = load_config(None, [f"data.train_path={train}", "data.task=null", "reward.name=exact",
                             f"data.test_path={tmp_path}/../{tmp_path.name}/train.jsonl", "buffer.batch_questions=64",
                             f"eval.sets.mine.path={train}", f"eval.sets.other.path={tmp_path / 'test.jsonl'}"])
    notes = data_notes(cfg, 2)
    assert notes[0] == ("buffer.batch_questions=64 is more than the 2 training question(s): every batch repeats them "
                        "(each ~32 times); set buffer.batch_questions at most 2, or use more data")
    assert [n.split(" is ")[0] for n in notes[1:]] == ["data.test_path", "eval.sets.mine.path"]
    assert "its numbers are training accuracy, not held-out accuracy" in notes[1]
    assert data_notes(cfg, 64)[0].startswith("data.test_path")
