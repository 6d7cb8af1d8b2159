"""Config mistakes people make, each answered through `exgrpo config` (exit 2, no traceback) with a line that
says what to change, in paths the user can type (issue 37); and the union shorthand the docs use."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import yaml

from cluster.cli import main
from common.config import load_config


def refused(capsys, *args: str) -> str:
    """`exgrpo config ARGS` exits 2 without a traceback; its stderr."""
    with pytest.raises(SystemExit) as e:
        main(["config", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("invalid configuration:") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("args, says", [
    # a key in the wrong section names the section where it lives
    (["learner.max_lag=1"], "learner.max_lag: unknown field (max_lag is not in learner: buffer.max_lag"),
    (["buffer.lr=1e-5"], "buffer.lr: unknown field (lr is not in buffer: learner.optim.lr or model.toy.lr"),
    (["generator.group_size=4"], "generator.group_size: unknown field (group_size is not in generator: "
                                 "buffer.group_size"),
    (["lr=1e-5"], "lr: unknown field (lr is in a section: learner.optim.lr or model.toy.lr"),
    (["learner.learning_rate=1e-5"], "learner.learning_rate: unknown field (did you mean learner.optim.lr?"),
    (["data.path=q.jsonl"], "data.path: unknown field (did you mean data.train_path, data.test_path or "
                            "data.chat_template_path?"),
    # paths without the kind's name, with a did-you-mean
    (["generator.engine.kind=vllm", "generator.engine.gpu_memory_utilisation=0.9"],
     "generator.engine.gpu_memory_utilisation: unknown field (did you mean generator.engine.gpu_memory_utilization?"),
    (["learner.weight_sync.kind=collective", "learner.weight_sync.relay_fanot=2"],
     "learner.weight_sync.relay_fanot: unknown field (did you mean learner.weight_sync.relay_fanout?"),
    (["learner.weight_sync.relay_fanot=2"], "relay_fanout is a field of kind collective, not of object_store: set "
                                            "learner.weight_sync.kind=collective"),
    # a field of another kind says which kind to set
    (["generator.engine.kind=transformers", "generator.engine.max_num_seqs=64"],
     "generator.engine.max_num_seqs: unknown field (max_num_seqs is a field of kind vllm, not of transformers: set "
     "generator.engine.kind=vllm"),
    (["generator.engine.kind=auto", "generator.engine.max_num_seqs=64"],
     "or generator.engine.vllm.max_num_seqs to keep kind auto"),
    # every kind that has it (a surrogate's band: ppo_clip's, gspo's and cispo's), and a policy loss given a list
    (["learner.loss.policy_loss=sapo", "learner.loss.policy_loss.clip_high=1"],
     "learner.loss.policy_loss.clip_high: unknown field (clip_high is a field of kind ppo_clip or gspo or cispo, not "
     "of sapo: set learner.loss.policy_loss.kind=ppo_clip"),
    (["learner.loss.policy_loss=[gspo]"], "learner.loss.policy_loss: a kind (ppo_clip, gspo, cispo, sapo) or a "
                                          "section of one, not ['gspo']: e.g. learner.loss.policy_loss=ppo_clip, or "
                                          "learner.loss.policy_loss.kind=ppo_clip with its fields"),
    (["generator.engine=[vllm]"], "generator.engine: a kind (vllm, transformers, auto) or a section of one, not "
                                  "['vllm']: e.g. generator.engine=auto"),
    (["learner.weight_sync=nccl"], "learner.weight_sync: kind: nccl was replaced by the collective backend"),
    (["generator.engine.max_num_seqs=64", "generator.engine.batch_rows=8"],
     "generator.engine: batch_rows is a field of kind transformers; max_num_seqs is a field of kind vllm: one kind "
     "at a time; set generator.engine.kind"),
    # no pydantic type names
    (["learner.loss.clip_fresh=maybe"], "learner.loss.clip_fresh: 'maybe' is not one of true, false, auto"),
    (["learner.levers.padding_free=maybe"], "learner.levers.padding_free: 'maybe' is not one of true, false, auto"),
    (["generator.dtype=fp8"], "generator.dtype: 'fp8' is not one of float32, bfloat16, float16, null"),
    (["generator.engine.kind=tpu"], "generator.engine: kind 'tpu' is not one of vllm, transformers, auto"),
    # a value given to a section shows the form
    (["tracking=false"], "tracking: a section, not a value (false): a section needs a key, written "
                         "tracking.<field>=false, e.g. tracking.enabled=false"),
    (["eval.sets.aime=aime.jsonl"], "eval.sets.aime: a section, not a value ('aime.jsonl'): a section needs a key, "
                                    "written eval.sets.aime.<field>=aime.jsonl, e.g. eval.sets.aime.path=aime.jsonl"),
    (["learner=0.00001"], "learner: a section, not a value (1.0e-05): a section needs a key, written "
                          "learner.<field>=1.0e-05 (its fields: num_ranks,"),  # no guess: learner.num_cpus is not it
    (["buffer.max_new_tokens=64"], "buffer.max_new_tokens: unknown field (max_new_tokens is not in buffer: "
                                   "generator.max_new_tokens;"),  # an exact name elsewhere beats buffer.max_bytes
    (["model.dtype=bf16"], "model.dtype: 'bf16' is not one of float32, bfloat16, float16; did you mean bfloat16?"),
    (["learner.levers.padding_free=ture"],
     "learner.levers.padding_free: 'ture' is not one of true, false, auto; did you mean true?"),
    (["learner.optim.lr=fast"], "learner.optim.lr: Input should be a valid number, unable to parse string as a number "
                                "(given 'fast')"),
    (["buffer.group_size=1"], "buffer.group_size: Input should be greater than or equal to 2 (given 1)"),
    (["learner.levers.compile_cache_dir=cache"], "learner.levers.compile_cache_dir: 'cache' is relative, and a learner "
                                                 "rank's working folder is Ray's, not yours: give an absolute path"),
    (["generator.node_labels=H100"], "generator.node_labels: a mapping, not 'H100': write "
                                     "generator.node_labels.<key>=<value>"),
    # lists and tuples with an example
    (["learner.optim.betas=0.9"], "learner.optim.betas: a list of 2 numbers, written [a, b], not 0.9: e.g. "
                                  "learner.optim.betas=[0.9, 0.999]"),
    (["learner.loss.icepop_band=2"], "e.g. learner.loss.icepop_band=[0.5, 2.0]"),
    (["generator.stop=3"], "generator.stop: a list, written [a, b]"),
    (["learner.optim.betas=[x, 0.9]"], "learner.optim.betas: item 1 'x': Input should be a valid number, unable to "
                                       "parse string as a number (a list of 2 numbers, written [a, b], e.g. "
                                       "learner.optim.betas=[0.9, 0.999])"),
    (["learner.optim.betas=[0.9]"], "learner.optim.betas: item 2 is missing (a list of 2 numbers"),
    (["generator.node_labels.group=1"], "generator.node_labels.group: Input should be a valid string (quote a number"),
    # the limit of a name
    (["name=" + "r" * 101], "name: 101 characters; a run name is at most 100"),
    # a value below a value
    (["buffer.group_size.x=1"], "buffer.group_size.x: group_size is a value, not a section"),
    # a reward the default task cannot use says how to keep it
    (["reward.name=math_think"], "set reward.name=countdown, or keep it with data.task=think_arith or "
                                 "data.train_path=<your data file>"),
])
def test_each_mistake_says_what_to_change(capsys, args, says):
    assert says in refused(capsys, *args)


def test_fields_of_a_union_without_kind_pick_the_kind():
    """The docs' shorthand: a field of the default kind keeps it, a field only one kind has sets that kind."""
    cfg = load_config(None, ["generator.engine.cpu_vllm_min_params=0"])
    assert cfg.generator.engine.kind == "auto" and cfg.generator.engine.cpu_vllm_min_params == 0
    cfg = load_config(None, ["generator.engine.vllm.max_num_seqs=8"])
    assert cfg.generator.engine.kind == "auto" and cfg.generator.engine.vllm.max_num_seqs == 8
    cfg = load_config(None, ["generator.engine.max_model_len=2048", "generator.engine.max_num_seqs=64"])
    assert cfg.generator.engine.kind == "vllm" and cfg.generator.engine.max_num_seqs == 64  # not synthetic's
    assert load_config(None, ["generator.engine.batch_rows=8"]).generator.engine.kind == "transformers"
    ws = load_config(None, ["learner.weight_sync.relay_fanout=2"]).learner.weight_sync
    assert ws.kind == "collective" and ws.relay_fanout == 2
    ws = load_config(None, ["learner.weight_sync.delta=true", "learner.weight_sync.bucket_mb=64"]).learner.weight_sync
    assert ws.kind == "object_store" and ws.delta


@pytest.mark.parametrize("kind_alone, field, kind_key, value", [
    ("generator.engine=transformers", "generator.engine.batch_rows=8", "transformers", ("batch_rows", 8)),
    ("learner.weight_sync=collective", "learner.weight_sync.relay_fanout=2", "collective", ("relay_fanout", 2)),
    ("learner.loss.policy_loss=gspo", "learner.loss.policy_loss.clip_high=0.001", "gspo", ("clip_high", 0.001)),
])
def test_every_section_chosen_by_its_kind_takes_the_kind_alone_and_its_fields_in_either_order(
        tmp_path, kind_alone, field, kind_key, value):
    """`generator.engine=transformers` as `learner.loss.policy_loss=gspo`: every section chosen by its kind (from the
    schema, not a list), on the command line and in a YAML file alike."""
    path = kind_alone.split("=")[0].split(".")
    for args in ([kind_alone], [kind_alone, field], [field, kind_alone]):
        section = load_config(None, args)
        for p in path:
            section = getattr(section, p)
        assert section.kind == kind_key, args
        if field in args:
            assert getattr(section, value[0]) == value[1], args
    (tmp_path / "c.yaml").write_text(f"{kind_alone.replace('=', ': ')}\n")
    section = load_config(str(tmp_path / "c.yaml"), [])
    for p in path:
        section = getattr(section, p)
    assert section.kind == kind_key


def test_every_flat_learner_key_that_moved_into_a_section_is_refused_with_its_new_name(tmp_path):
    """`learner.lr` -> `learner.optim.lr`, ... : each of the 44 fields that left the flat learner, given on the
    command line or nested in a YAML file, gets one line naming its section; none is taken silently. The 9
    surrogate parameters that `learner.loss` held flat (`clip_high`, `gspo_clip_low`, ...), under either old
    name, get the path in their surrogate's section and the kind it needs."""
    from common.config import BatchingConfig, ConfigError, LeversConfig, LossConfig, OptimConfig
    from common.config.loss import FLAT_SURROGATE_KEYS

    moved = {f"learner.{name}": f"learner.{section}.{name}" for section, model in
             (("optim", OptimConfig), ("batching", BatchingConfig), ("levers", LeversConfig), ("loss", LossConfig))
             for name in model.model_fields}
    assert len(moved) == 44 and moved["learner.lr"] == "learner.optim.lr"
    assert moved["learner.compile"] == "learner.levers.compile"
    for old, new in moved.items():
        nested = tmp_path / "run.yaml"
        nested.write_text(f"learner:\n  {old.split('.')[1]}: 1\n")
        for args in ((None, [f"{old}=1"]), (nested, [])):
            with pytest.raises(ConfigError) as e:
                load_config(*args)
            assert f"{old}: renamed: set {new} instead (same meaning)" in e.value.lines, e.value.lines
    hint = {"clip_high": "set learner.loss.policy_loss.clip_high (of kind ppo_clip, the default)",
            "gspo_clip_low": "set learner.loss.policy_loss.clip_low with learner.loss.policy_loss.kind=gspo",
            "sapo_tau_neg": "set learner.loss.policy_loss.tau_neg with learner.loss.policy_loss.kind=sapo"}
    for flat in FLAT_SURROGATE_KEYS:
        for old in (f"learner.{flat}", f"learner.loss.{flat}"):
            with pytest.raises(ConfigError) as e:
                load_config(None, [f"{old}=1.5"])
            assert len(e.value.lines) == 1 and e.value.lines[0].startswith(
                f"{old}: moved into the surrogate's own section: set learner.loss.policy_loss."), e.value.lines
            assert hint.get(flat, "") in e.value.lines[0]


def test_a_run_saved_under_the_old_names_is_read_under_the_new_ones(tmp_path):
    """A run folder's config.yaml from before the sections (flat learner keys, `official` values, the surrogate's
    parameters flat beside `policy_loss: gspo`): the user did not type it, so `load_saved_config` moves each old
    name to its new one and says which (the other surrogates' parameters, which did nothing, are dropped and
    named); load_config, for what the user types, still refuses them."""
    from common.config import ConfigError, load_saved_config, to_yaml
    from common.config.loss import FLAT_SURROGATE_KEYS

    saved = yaml.safe_load(to_yaml(load_config(None, ["learner.optim.lr=3e-4"])))
    learner = saved["learner"]
    learner["loss"]["policy_loss"] = "gspo"  # the earlier release: the kind as a value, every parameter flat
    learner["loss"].update({flat: 0.5 for flat in FLAT_SURROGATE_KEYS}, gspo_clip_high=0.001, clip_ratio_c=None)
    for section in ("optim", "batching", "levers", "loss"):
        learner.update(learner.pop(section))  # the flat learner of the earlier release
    learner["official_world_size"] = learner.pop("loss_world_size")
    saved["buffer"].update(fresh_draw="official", trajectory_score="official")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved))
    cfg, moved = load_saved_config(path)
    assert cfg.learner.optim.lr == pytest.approx(3e-4)
    assert cfg.learner.loss.policy_loss.model_dump() == {"kind": "gspo", "clip_low": 0.5, "clip_high": 0.001}
    assert cfg.buffer.fresh_draw == "per_step" and cfg.buffer.trajectory_score == "chunk_window"
    assert len(moved) == 43 + 9 + 1 + 2 + 9 and "learner.lr -> learner.optim.lr" in moved
    assert "learner.official_world_size -> learner.loss.loss_world_size" in moved
    assert "learner.loss.gspo_clip_high -> learner.loss.policy_loss.clip_high" in moved
    assert "learner.loss.sapo_tau_pos dropped (a parameter of sapo; the run's policy loss is gspo)" in moved
    assert "buffer.fresh_draw=official -> per_step" in moved
    current = tmp_path / "current.yaml"
    current.write_text(to_yaml(cfg))
    assert load_saved_config(current) == (cfg, [])  # a config of this release: nothing moved
    with pytest.raises(ConfigError, match="renamed: set learner.optim.lr instead"):
        load_config(path)


def test_a_dotted_label_key_is_one_key():
    cfg = load_config(None, ["generator.node_labels.ray.io/accelerator-type=H100", "learner.node_labels.group=train"])
    assert cfg.generator.node_labels == {"ray.io/accelerator-type": "H100"}
    assert cfg.learner.node_labels == {"group": "train"}


def test_dotted_keys_in_a_yaml_config_set_nested_fields(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("learner.optim.lr: 1.0e-5\nbuffer:\n  max_lag: 0\n  replay_ratio: 0.25\n"
                 "generator:\n  engine.kind: vllm\n  node_labels: {ray.io/accelerator-type: H100}\n")
    cfg = load_config(f)
    assert cfg.learner.optim.lr == 1e-5 and cfg.buffer.max_lag == 0 and cfg.generator.engine.kind == "vllm"
    assert cfg.generator.node_labels == {"ray.io/accelerator-type": "H100"}


def test_a_second_config_file_is_named_as_one(capsys, tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("buffer: {max_lag: 0}\n")
    b.write_text("learner: {optim: {lr: 1.0e-5}}\n")
    err = refused(capsys, str(a), str(b))
    assert f"{b}: one config file per command (the config is {a}); merge the files, or give {b}'s settings as " \
           "key=value overrides" in err


@pytest.mark.parametrize("name, content, says", [
    ("train.jsonl", b'{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer": "4"}\n',
     "this looks like a data file, not a config; pass it as data.train_path="),
    ("rows.yaml", b'{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer": "4"}\n',
     "this looks like a JSONL data file, not a config; data files are named .jsonl or .parquet: rename it (mv "),
    ("one.json", b'{"question": "1+1", "answer": "2"}\n', "this looks like a data file (a row with question, answer)"),
    ("train.parquet", b"PAR1\x15\x04\x15\x80\x01\x15\x90\x01\x00\x00\xff\xfe", "this looks like a Parquet data file"),
    ("data", gzip.compress(b'{"question": "1+1"}\n', mtime=0), "this looks like a compressed data file"),
    ("blob.yaml", b"buffer:\n  max_lag: \xff\xfe\x00\n", "not a text file (byte 19 is not UTF-8); a config is a YAML "
                                                           "file of sections"),
])
def test_a_data_or_binary_file_given_as_the_config_is_named(capsys, tmp_path, name, content, says):
    f = tmp_path / name
    f.write_bytes(content)
    assert says in refused(capsys, str(f))


def test_config_reports_what_train_checks_at_start(capsys, tmp_path):
    """A config that validates but that `train` refuses on this machine: printed, and exit 2 with the reasons."""
    code = main(["config", f"model.path={tmp_path / 'no-model'}", f"data.train_path={tmp_path / 'no.jsonl'}",
                 f"data.test_path={tmp_path / 'no-test.jsonl'}", "reward.name=nopkg.nomod:fn"])
    out, err = capsys.readouterr()
    assert code == 2 and yaml.safe_load(out)["model"]["path"] == str(tmp_path / "no-model")
    assert "exgrpo train refuses this config on this machine" in err and "Traceback" not in err
    assert f"model.path: {tmp_path / 'no-model'} does not exist, so it is not a Hugging Face model folder" in err
    assert f"data.train_path: {tmp_path / 'no.jsonl'} is not a file" in err
    assert f"data.test_path: {tmp_path / 'no-test.jsonl'} is not a file" in err
    assert "reward.name: cannot import module 'nopkg.nomod'" in err


def test_no_line_shows_pydantic_internals_or_a_kind_tag():
    """Every field given a wrong value of each shape: the lines name typeable paths and no pydantic type names."""
    import re

    from common.config import ConfigError
    from common.config.schema import leaf_paths

    internals = re.compile(r"literal\[|Union\[|instance of|valid (tuple|list|dictionary)|\bbool\b:|function-after|"
                           r"engine\.auto\.|engine\.vllm\.vllm|weight_sync\.(collective|object_store)\.")
    shown = []
    for path, kind in leaf_paths():
        if kind == "synthetic":
            continue
        union = next((u for u in ("generator.engine", "learner.weight_sync") if path.startswith(u + ".")), None)
        nested = path.startswith(("generator.engine.vllm.", "generator.engine.transformers."))  # auto's own
        given = [f"{union}.kind={kind}"] if kind and union and not nested else []
        for value in ("zzz", "[1, 2, 3]", "{a: 1}", "-5"):
            try:
                load_config(None, [*given, f"{path.replace('<name>', 'x')}={value}"])
            except ConfigError as e:
                shown += [line for line in e.lines if internals.search(line)]
    assert not shown, shown


@pytest.mark.parametrize("content, says", [
    (b"buffer:\n  group_size: 8\n  group_size: 4\n",
     "a.yaml, line 3: group_size is given twice (lines 2 and 3); the second would replace the first"),
    (b"buffer:\n  group_size: 8\nlearner: {optim: {lr: 1.0e-5}}\nbuffer:\n  max_lag: 0\n",
     "a.yaml, line 4: buffer is given twice (lines 1 and 4); the second would replace the first (a section given "
     "twice loses the first one's keys): keep one"),
    (b"learner.optim.lr: 1.0e-5\nlearner:\n  optim:\n    lr: 2.0e-5\n",
     "a.yaml, line 4: learner.optim.lr is given twice, once as a dotted key and once nested in its section (lines 1 "
     "and 4); keep one"),
    (b"learner.lora: {rank: 8}\nlearner:\n  lora:\n    alpha: 16\n", "learner.lora is given twice"),
    (b"buffer:\n\tgroup_size: 8\n", "a.yaml, line 2: a tab; YAML indents with spaces only"),
    (b"buffer: {group_size: 8}\n---\nlearner: {optim: {lr: 1}}\n",
     "a.yaml, line 2: a second YAML document ('---'); one file holds one document"),
    (b"buffer: [1, 2\n", "a.yaml, line 2: not valid YAML: expected ',' or ']', but got '<stream end>' (while "
                         "parsing a flow sequence that starts on line 1)"),
    (b"buffer:\n  max_lag: 0\nname: caf\xe9\n", "a.yaml, line 3: not a text file (byte 30 is not UTF-8)"),
])
def test_yaml_mistakes_name_the_file_and_line(capsys, tmp_path, content, says):
    f = tmp_path / "a.yaml"
    f.write_bytes(content)
    err = refused(capsys, str(f))
    assert says in err and "<unicode string>" not in err, err


def test_a_dotted_key_inside_its_own_section_merges(tmp_path):
    f = tmp_path / "a.yaml"
    f.write_text("learner:\n  lora.rank: 8\n  lora:\n    alpha: 16\n")
    lora = load_config(f).learner.lora
    assert (lora.rank, lora.alpha) == (8, 16)


def test_a_hub_id_as_model_path_says_how_to_download_it(capsys):
    assert main(["config", "model.path=Qwen/Qwen2.5-0.5B-Instruct"]) == 2
    assert ("model.path: Qwen/Qwen2.5-0.5B-Instruct does not exist here; it looks like a Hugging Face hub id, and "
            "runs load a folder and never download: download it first (.venv/bin/hf download "
            "Qwen/Qwen2.5-0.5B-Instruct --local-dir models/Qwen2.5-0.5B-Instruct) and set "
            "model.path=models/Qwen2.5-0.5B-Instruct") in capsys.readouterr().err


def test_the_compile_cache_dir_is_absolute_with_home_expanded():
    home = load_config(None, ["learner.levers.compile_cache_dir=~/inductor"]).learner.levers.compile_cache_dir
    assert home == str(Path.home() / "inductor")
    assert load_config(None, ["learner.levers.compile_cache_dir=/shared/c"]).learner.levers.compile_cache_dir == "/shared/c"
    assert load_config(None, []).learner.levers.compile_cache_dir is None


@pytest.mark.parametrize("text, field, value", [("name: on\n", "name", "true"), ("data: {question_field: no}\n",
                                                                               "data.question_field", "false")])
def test_a_text_field_given_yaml_s_yes_no_on_off_says_to_quote_it(capsys, tmp_path, text, field, value):
    f = tmp_path / "spec.yaml"
    f.write_text(text)
    err = refused(capsys, str(f))
    assert f"{field}: text expected, but YAML read the value as the boolean {value}" in err and "quote it" in err, err
    assert "Input should be a valid string" not in err
    quoted = f.read_text().replace(": on", ": 'on'").replace(": no", ": 'no'")
    f.write_text(quoted)
    cfg = load_config(f)  # quoted, as the message says: text
    assert (cfg.name if field == "name" else cfg.data.question_field) in ("on", "no")


def test_a_list_of_rows_given_as_the_config_gets_a_command_that_makes_a_data_file(capsys, tmp_path):
    """The advice works as written: the command converts the rows to JSON Lines, which data.train_path reads."""
    import shlex
    import subprocess

    rows = tmp_path / "list.yaml"
    rows.write_text('- {question: "1+1", answer: "2"}\n- {question: "2+2", answer: "4"}\n')
    err = refused(capsys, str(rows))
    assert "this looks like a data file (a list of rows), not a config; data files are JSON Lines" in err, err
    command = err.split("convert it with ", 1)[1].split(" and pass ")[0]
    assert err.rstrip().endswith(f"pass data.train_path={tmp_path / 'list.jsonl'}"), err
    subprocess.run(command, shell=True, check=True, cwd=tmp_path)
    capsys.readouterr()
    assert main(["config", f"data.train_path={tmp_path / 'list.jsonl'}", "reward.name=exact"]) == 0, \
        capsys.readouterr().err
    from common.data import read_rows

    assert [r for _, r in read_rows(tmp_path / "list.jsonl")] == [{"question": "1+1", "answer": "2"},
                                                                   {"question": "2+2", "answer": "4"}]
    assert shlex.split(command)[0] == __import__("sys").executable


def test_a_test_path_without_a_train_path_is_refused_not_ignored(capsys, tmp_path):
    """The built-in task makes its own test split: data.test_path alone was silently ignored."""
    err = refused(capsys, "data.test_path=held.jsonl")
    assert ("data.test_path: held.jsonl is a held-out split of data.train_path, which is not set (the built-in "
            "countdown task makes its own test split); set data.train_path to your training file, or evaluate the "
            "file beside the task with eval.sets.<name>.path=held.jsonl") in err, err
    cfg = load_config(None, ["data.test_path=held.jsonl", "data.train_path=train.jsonl", "reward.name=exact"])
    assert cfg.data.test_path == "held.jsonl"
    held = tmp_path / "held.jsonl"
    held.write_text('{"question": "1+1=", "answer": "2"}\n')
    assert load_config(None, [f"eval.sets.held.path={held}"]).eval.sets["held"].path == str(held)  # the other way


@pytest.mark.parametrize("override, line", [
    ("learner.official_world_size=8", "learner.official_world_size: renamed: set learner.loss.loss_world_size instead"),
    ("buffer.fresh_draw=official", "buffer.fresh_draw: 'official' was renamed: set buffer.fresh_draw=per_step"),
    ("buffer.trajectory_score=official",
     "buffer.trajectory_score: 'official' was renamed: set buffer.trajectory_score=chunk_window"),
])
def test_a_renamed_key_or_choice_is_refused_with_its_new_name(capsys, override, line):
    err = refused(capsys, override)
    assert line in err, err
