"""Bad input as a new user types it: every case ends with a message that names what to change, exit code 2,
no traceback, and nothing left behind (no run folder, no silently dropped setting). No Ray is started.

Most cases call the CLI in-process; a few run `python -m cluster.cli` as a user would."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import main

ROOT = Path(__file__).resolve().parents[2]


def cli(capsys, *argv: str) -> tuple[int, str]:
    """Exit code and everything printed, whether `main` returns or exits (argparse, config errors)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out + out.err


def cli_process(*argv: str, cwd: Path = ROOT) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "cluster.cli", *map(str, argv)], cwd=cwd, capture_output=True,
                       text=True, timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    return p.returncode, p.stdout + p.stderr


def assert_refused(code: int, out: str, *expected: str) -> None:
    assert code == 2, out
    assert "Traceback" not in out, out
    for e in expected:
        assert e in out, f"{e!r} not in:\n{out}"


# ------------------------------------------------------------------------------------ config level


@pytest.mark.parametrize("args, expected", [
    (["name=../../x"], ["name: '../../x' is not a run name", "e.g. name=my-run-1"]),
    (["name=/tmp/x"], ["name: '/tmp/x' is not a run name"]),
    (["name=.."], ["name: '..' is not a run name"]),
    (["name=a/b"], ["name: 'a/b' is not a run name"]),
    (["reward.name=nosuch"], ["reward.name: unknown reward 'nosuch'", "countdown", "package.module:function"]),
    (["reward.name=mth"], ["reward.name: unknown reward 'mth'; did you mean math?"]),
    (["learner.optim.betas=[0.9, 1.0]"], ["learner.optim.betas: beta2 = 1.0 is outside [0, 1)"]),
    (["learner.optim.betas=[-0.1, 0.9]"], ["learner.optim.betas: beta1 = -0.1 is outside [0, 1)"]),
    (["buffer.group_size", "8"], ["overrides are written key=value: did you mean buffer.group_size=8?"]),
    (["buffer.group_size", "=", "8"], ["did you mean buffer.group_size=8?"]),
    (["total_steps"], ["did you mean total_steps=<value>?"]),
    (["total_steps="], ["total_steps=: an override is written key=value", "no value after '='"]),
    (["=3"], ["=3: an override is written key=value", "no key before '='"]),
    (["nope.yaml"], ["nope.yaml: config file not found"]),
    (["foo.bar=1"], ["foo: unknown field"]),
    (["buffer.grup_size=4"], ["buffer.grup_size: unknown field (did you mean buffer.group_size?"]),
    (["total_steps=-1"], ["total_steps: Input should be greater than or equal to 1"]),
    (["seed=1099511627776"], ["seed: Input should be less than or equal to 4294967295"]),
    (["learner.batching.mini_batches=1000"], ["learner.batching.mini_batches: 1000 does not divide "
                                              "buffer.batch_questions 16"]),
    (["buffer=3"], ["buffer: a section, not a value (3): a section needs a key, written buffer.<field>=3"]),
    (["generator.engine.batch_rows=4", "generator.engine.max_num_seqs=8"],
     ["generator.engine: batch_rows is a field of kind transformers; max_num_seqs is a field of kind vllm: one kind "
      "at a time; set generator.engine.kind"]),
    (["generator.engine.kind=synthetic"], ["synthetic is a simulation for bench/cluster_sim.py"]),
    (["learner.optim.warmup_steps=500", "total_steps=10"],
     ["learner.optim.warmup_steps: 500 warmup steps outlast the schedule's 10 steps (total_steps): the learning rate would "
      "never reach learner.optim.lr; set learner.optim.warmup_steps at most 10"]),
    (["learner.num_ranks=4", "buffer.batch_questions=1", "buffer.group_size=2"],
     ["learner.num_ranks: 4 ranks share 2 rows per mini-batch (buffer.batch_questions 1 x buffer.group_size 2 / "
      "learner.batching.mini_batches 1): a rank would get none; set learner.num_ranks at most 2"]),
    (["generator.questions_per_lease=10000", "buffer.batch_questions=1"],
     ["generator.questions_per_lease: 10000 is more than a lease can ever hold: the buffer issues at most "
      "buffer.batch_questions x (buffer.max_lag + 1) = 2 questions ahead", "set it at most 2"]),
    (["learner.loss.policy_loss=cispo", "learner.loss.clip_fresh=auto"],
     ["learner.loss.clip_fresh=auto turns PPO's clip off", "learner.loss.policy_loss.kind=cispo has no unclipped form"]),
])
def test_bad_config_is_refused_naming_the_field(capsys, args, expected):
    code, out = cli(capsys, "config", *args)
    assert_refused(code, out, "invalid configuration:", *expected)
    assert "at most 0" not in out  # no advice that cannot be followed


def test_bad_config_files_are_refused(capsys, tmp_path):
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "broken.yaml").write_text("buffer: [1, 2\n")
    assert_refused(*cli(capsys, "config", tmp_path / "list.yaml"), "top level must be a mapping")
    assert_refused(*cli(capsys, "config", tmp_path / "broken.yaml"), "not valid YAML")
    assert_refused(*cli(capsys, "config", tmp_path), "is a folder; pass a YAML config file")
    assert_refused(*cli(capsys, "config", tmp_path / "list.yaml", "group_size", "8"),
                   "did you mean group_size=8?")


def test_a_response_longer_than_the_model_is_reported_by_config(capsys):
    code, out = cli(capsys, "config", "generator.max_new_tokens=100000")
    assert code == 2 and "exgrpo train refuses this config" in out and "generator.max_new_tokens: 100000 tokens do " \
        "not fit the built-in model's 512 positions (the prompt included); set it below 512, or raise " \
        "model.toy.max_positions" in out, out


def test_a_user_reward_that_cannot_be_called_with_response_and_answer_is_refused(capsys):
    code, out = cli(capsys, "config", "reward.name=os:system")
    assert code == 2 and "reward.name: os:system takes (command), not (response, answer); a reward is a function " \
                         "fn(response: str, answer: str) -> float" in out, out


def test_good_names_and_user_rewards_are_accepted(capsys):
    code, out = cli(capsys, "config", "name=7", "reward.name=tests.common.reward_fns:good")
    assert code == 0 and "name: '7'" in out and "tests.common.reward_fns:good" in out
    # a user reward that does not import on this machine: the config is printed, and why train would refuse it
    code, out = cli(capsys, "config", "reward.name=my_pkg.rewards:score")
    assert code == 2 and "my_pkg.rewards:score" in out and "reward.name: cannot import module 'my_pkg.rewards'" in out


# ------------------------------------------------------------------------- train: checked before the folder


@pytest.fixture
def runs(tmp_path) -> Path:
    return tmp_path / "runs"


def train(capsys, runs: Path, *overrides: str) -> tuple[int, str]:
    return cli(capsys, "train", f"checkpoint.runs_root={runs}", "tracking.enabled=false", "name=r", *overrides)


def model_copy(src: Path, dst: Path, drop: tuple[str, ...] = (), config: str | None = None) -> Path:
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        if f.name in drop or any(f.name.endswith(d) for d in drop if d.startswith(".")):
            f.unlink()
    if config is not None:
        (dst / "config.json").write_text(config)
    return dst


@pytest.mark.parametrize("drop, config, expected", [
    (("tokenizer.json", "tokenizer_config.json"), None, "has no tokenizer files"),
    ((), '{"model_type": "llama", ', "config.json is not readable JSON"),
    ((".safetensors",), None, "has no weights"),
    ((), '["not", "a", "config"]', "has no model_type"),
])
def test_unusable_model_folder_is_refused_before_the_run_folder(capsys, runs, tmp_path, tiny_model_dir, drop,
                                                                config, expected):
    model = model_copy(tiny_model_dir, tmp_path / "model", drop, config)
    assert_refused(*train(capsys, runs, f"model.path={model}"), "model.path:", expected)
    assert not (runs / "r").exists()


def test_missing_model_folder_and_unimportable_reward_leave_no_run_folder(capsys, runs, tmp_path, tiny_model_dir):
    assert_refused(*train(capsys, runs, f"model.path={tmp_path / 'nope'}"), "model.path:", "does not exist")
    assert_refused(*train(capsys, runs, f"model.path={tiny_model_dir}", "data.task=arithmetic",
                          "reward.name=nosuchmod:score"), "reward.name: cannot import module 'nosuchmod'")
    assert not (runs / "r").exists()


@pytest.mark.parametrize("content, heading, expected", [
    (None, "invalid configuration:", "train.jsonl is not a file"),
    ("", "invalid data:", "no usable training questions"),
    ('{"q": "1+1", "a": "2"}\n' * 3, "invalid data:", "data.question_field / data.answer_field name the fields"),
])
def test_unusable_data_is_refused_and_the_name_stays_free(capsys, monkeypatch, runs, tmp_path, tiny_model_dir,
                                                          content, heading, expected):
    import tempfile

    import ray

    data = tmp_path / "train.jsonl"
    if content is not None:
        data.write_text(content)
    args = (f"model.path={tiny_model_dir}", f"data.train_path={data}", "reward.name=exact")
    made = []  # the temp folders of the embedded Ray this command starts
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, mkdtemp=tempfile.mkdtemp, **k: made.append(mkdtemp(*a, **k))
                        or made[-1])
    assert_refused(*train(capsys, runs, *args), heading, expected)
    assert not (runs / "r").exists()
    # data is read while Ray starts (after the quick checks): a refusal then stops it and leaves no temp folder
    assert not ray.is_initialized() and not [t for t in made if Path(t).exists()], made
    code, out = train(capsys, runs, *args)  # the same name again: the same answer, not "already holds a run"
    assert "already holds a run" not in out


def test_own_data_scored_by_a_verifier_that_cannot_read_its_answers_is_refused(capsys, runs, tmp_path):
    """math.jsonl with the default reward (countdown, the built-in task's): every rollout would score 0."""
    data = tmp_path / "math.jsonl"
    data.write_text('{"question": "1/2 + 1/2?", "answer": "1"}\n{"question": "x", "answer": "\\\\frac{1}{2}"}\n')
    says = (f"reward.name: countdown cannot read the reference answers of data.train_path {data} (its first rows "
            "have '1', '\\\\frac{1}{2}'; countdown expects JSON text such as "
            '{"target": 24, "numbers": [3, 5, 8]}); set reward.name to the reward for your data: math '
            "(math-verify), math_think")
    code, out = cli(capsys, "config", f"data.train_path={data}")
    assert code == 2 and says in out and "exgrpo train refuses this config" in out, out
    assert_refused(*train(capsys, runs, f"data.train_path={data}"), "invalid configuration:", says)
    assert not (runs / "r").exists()
    for reward in ("math", "arithmetic"):  # arithmetic reads one of them ('1'): that is enough
        code, out = cli(capsys, "config", f"data.train_path={data}", f"reward.name={reward}")
        assert code == 0, out


def test_a_task_with_a_data_file_is_refused_with_why(capsys):
    assert_refused(*cli(capsys, "config", "data.train_path=x.jsonl", "data.task=think_arith"),
                   "data.task: think_arith is not used when data.train_path is set (the questions come from x.jsonl, "
                   "not from the task): set data.task=null; for your data in the think_arith format set "
                   "reward.name=math_think data.use_chat_template=true; or leave out data.train_path to train on the "
                   "built-in think_arith task")
    code, out = cli(capsys, "config", "data.train_path=x.jsonl", "data.task=countdown")  # `exgrpo config`'s output
    assert "data.task" not in out.split("refuses")[-1], out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU: nothing to refuse")
def test_gpus_asked_of_a_local_run_without_any_are_warned_by_config_and_refused_by_train(capsys, runs):
    says = ("learner.num_gpus=1, generator.num_gpus=0.5: GPUs asked of a local run, but this machine has none "
            "(torch.cuda.is_available() is False); set learner.num_gpus=0 generator.num_gpus=0, or cluster.address "
            "to a Ray cluster with GPUs")
    code, out = cli(capsys, "config", "learner.num_gpus=1", "generator.num_gpus=0.5")  # a GPU run's config: valid
    assert code == 0 and f"warning: exgrpo train refuses this config on this machine: {says}" in out, out
    assert_refused(*train(capsys, runs, "learner.num_gpus=1", "generator.num_gpus=0.5"), "invalid configuration:", says)
    assert not (runs / "r").exists()
    code, out = cli(capsys, "config", "learner.num_gpus=1", "cluster.address=auto")  # the cluster's GPUs: not ours
    assert "GPUs asked" not in out, out


def test_a_ray_that_cannot_start_is_one_line_and_leaves_no_run_folder(capsys, runs, tiny_model_dir):
    """Before, Ray's own traceback, and a run folder left RUNNING that a later --resume trained from step 0."""
    code, out = train(capsys, runs, f"model.path={tiny_model_dir}", "cluster.temp_dir=/proc/nope")
    assert code == 1 and "Traceback" not in out, out
    assert "error: Ray did not start (FileNotFoundError: [Errno 2] No such file or directory: '/proc/nope'); nothing " \
           "was trained" in out, out
    assert f"removed {runs / 'r'} so that name=r can be used again" in out and not (runs / "r").exists()


def test_runs_root_that_is_a_file_is_refused(capsys, tmp_path, tiny_model_dir):
    (tmp_path / "file").write_text("")
    assert_refused(*train(capsys, tmp_path / "file", f"model.path={tiny_model_dir}"),
                   "checkpoint.runs_root:", "is a file, not a folder")


# ---------------------------------------------------------------------------------------------- resume


def make_checkpoint(run: Path, step: int) -> Path:
    """A checkpoint folder with every file the resume check reads (tiny contents)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from buffer.client import SWITCH_FILE
    from buffer.shard import pack
    from buffer.snapshot import snapshot_path, write_snapshot
    from learner import checkpoint as ck

    c = run / "checkpoints" / f"step-{step:06d}"
    for sub in ("model", "optimizer", "rng"):
        (c / "learner" / sub).mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(c / "learner" / "model" / "model.safetensors"))
    (c / "learner" / "model" / "config.json").write_text('{"model_type": "llama"}')
    (c / "learner" / "rng" / "rank0.json").write_text("{}")
    dcp.save({"optim": {"param_groups": [{"lr": 1e-3}]}}, checkpoint_id=str(c / "learner" / "optimizer"), no_dist=True)
    ck.write_meta(c / "learner", step=step, version=step, num_ranks=1)
    write_snapshot(snapshot_path(c / "buffer", 0), {"shard": 0, "store": {"segments": {}}})
    (c / "buffer" / SWITCH_FILE).write_bytes(pack({"on": False}))
    (c / "driver.json").write_text(json.dumps({"step": step, "generators": 1, "rollouts": 128 * step}))
    return c


@pytest.fixture
def run(runs, tiny_model_dir) -> Path:
    """A run folder (total_steps=4) with checkpoints at steps 1 and 2, as `exgrpo train` leaves it."""
    from cluster.runtime import RunDir
    from common.config import load_config

    cfg = load_config(None, [f"checkpoint.runs_root={runs}", "name=r", f"model.path={tiny_model_dir}",
                             "data.task=arithmetic", "reward.name=arithmetic", "data.num_train=50", "total_steps=4",
                             "tracking.enabled=false"])
    rd = RunDir.create(cfg)
    rd.update_state(checkpoints=[str(make_checkpoint(rd.path, s)) for s in (1, 2)], status="KILLED", step=2)
    return rd.path


def test_resume_refuses_settings_the_checkpoint_was_built_with(capsys, run):
    before = (run / "config.yaml").read_text()
    assert_refused(*cli(capsys, "train", "--resume", run, "buffer.group_size=4", "total_steps=9"),
                   "buffer.group_size cannot change on resume: the checkpoint's buffer was built with 8",
                   "fields that may change on resume: total_steps")
    assert_refused(*cli(capsys, "train", "--resume", run, "buffer.grup_size=4"),
                   "buffer.grup_size: unknown field (did you mean buffer.group_size?")
    assert_refused(*cli(capsys, "train", "--resume", run, run / "config.yaml"),
                   "--resume continues with the run's own config.yaml")
    assert (run / "config.yaml").read_text() == before


def test_resume_applies_safe_overrides_and_keeps_them(run):
    from cluster.run import _prepare
    from cluster.runtime import RunDir

    cfg, rd, state, _, _ = _prepare(None, str(run), ["total_steps=6", "generator.num_generators=3",
                                                      "checkpoint.every_steps=2"])
    assert (cfg.total_steps, cfg.checkpoint.every_steps, state.generators, state.step) == (6, 2, 3, 2)
    assert RunDir(run).config().total_steps == 6  # a later resume keeps them


def test_resume_falls_back_from_a_corrupt_newest_checkpoint(run, caplog):
    from cluster.run import _prepare
    from cluster.runtime import RunDir

    (run / "checkpoints" / "step-000002" / "learner" / "meta.json").write_text('{"format": 1, "st')
    _, rd, state, _, _ = _prepare(None, str(run), [])
    assert state.step == 1 and rd.latest_checkpoint() == run / "checkpoints" / "step-000001"
    assert (run / "checkpoints" / "step-000002.unusable").is_dir()  # kept for inspection, not deleted
    assert "step-000002 is unusable" in caplog.text and "resuming from step-000001" in caplog.text
    assert RunDir(run).read_state()["checkpoints"] == ["checkpoints/step-000001"]  # now relative to the folder


def test_resume_without_a_usable_checkpoint_changes_nothing(capsys, run):
    (run / "checkpoints" / "step-000001" / "driver.json").write_text("{")
    snapshot = run / "checkpoints" / "step-000002" / "buffer" / "buffer-shard-0.msgpack"
    snapshot.write_bytes(snapshot.read_bytes()[:-3])
    state = (run / "state.json").read_text()
    assert_refused(*cli(capsys, "train", "--resume", run), "has no usable checkpoint",
                   "step-000001: driver.json is corrupt", "step-000002: buffer snapshot", "name=<new name>")
    assert (run / "state.json").read_text() == state and (run / "checkpoints" / "step-000002").is_dir()


def test_resume_of_a_finished_run_says_how_to_go_on(capsys, run):
    assert_refused(*cli(capsys, "train", "--resume", run, "total_steps=2"), "already reached total_steps=2",
                   f"exgrpo train --resume {run} total_steps=4")
    # a run stopped by its rollout budget (exgrpo experiment) is finished too
    assert_refused(*cli(capsys, "train", "--resume", run, "total_rollouts=256"),
                   "already spent total_rollouts=256 (256 trained)", f"exgrpo train --resume {run} total_rollouts=512")


def test_resume_with_a_corrupt_state_json_names_the_file_and_the_fix(capsys, run):
    (run / "state.json").write_text('{"name": "r", "checkp')
    assert_refused(*cli(capsys, "train", "--resume", run), "state.json is corrupt",
                   '"checkpoints": ["checkpoints/step-000001", "checkpoints/step-000002"]')
    assert_refused(*cli(capsys, "train", "--resume", run.parent / "nope"), "is not a run folder (no state.json)")


def test_a_new_run_never_adopts_a_folder_that_holds_anything(capsys, runs, tiny_model_dir):
    """Before, `name=r` over a user's folder wrote config.yaml and state.json into it, and a refusal at placement then
    removed the folder with everything in it."""
    (runs / "r").mkdir(parents=True)
    (runs / "r" / "notes.txt").write_text("mine")
    assert_refused(*train(capsys, runs, f"model.path={tiny_model_dir}"),
                   f"{runs / 'r'} already exists and is not empty (notes.txt); a new run goes into a new or empty "
                   "folder: pass name=<new name>")
    assert sorted(p.name for p in (runs / "r").iterdir()) == ["notes.txt"]


def test_a_refused_run_removes_only_what_it_wrote(runs):
    from cluster.runtime import RunDir

    made = RunDir(runs / "made")
    made.made_folder = True
    empty = RunDir(runs / "empty")  # was there before the run (empty), so it stays
    for rd in (made, empty):
        (rd.path / "logs").mkdir(parents=True)
        for f in ("state.json", "config.yaml", ".state.json.tmp-12", "ray_address"):
            (rd.path / f).write_text("{}")
    assert made.remove_own() == [] and not made.path.exists()
    (empty.path / "theirs.txt").write_text("dropped in meanwhile")
    assert empty.remove_own() == ["theirs.txt"] and empty.path.is_dir()


def test_a_copied_run_folder_resumes_from_its_own_checkpoints_into_a_new_mlflow_run(run, caplog):
    """state.json listed checkpoints by absolute path (as the `run` fixture still writes them, like an earlier
    release): a copy resumed the original's checkpoint, logged into its MLflow run and rotated its checkpoints away.
    Now every entry is read inside the folder that is resumed; a move continues the MLflow run, a copy starts one."""
    from cluster.run import _prepare
    from cluster.runtime import RunDir

    caplog.set_level("INFO", logger="exgrpo")  # the move is said at INFO
    RunDir(run).update_state(mlflow_run_id="abc")
    original = (run / "state.json").read_text()
    copy = shutil.copytree(run, run.parent / "copy")
    _, rd, state, _, _ = _prepare(None, str(copy), [])
    assert rd.latest_checkpoint() == copy / "checkpoints" / "step-000002" and state.mlflow_run_id is None
    assert f"{copy} is a copy of {run} (still there)" in caplog.text
    assert RunDir(copy).read_state()["checkpoints"] == ["checkpoints/step-000001", "checkpoints/step-000002"]
    assert (run / "state.json").read_text() == original  # the original is not touched
    moved = copy.rename(run.parent / "moved")
    RunDir(moved).update_state(mlflow_run_id="def")
    _, rd, state, _, _ = _prepare(None, str(moved), [])
    assert rd.checkpoints() == [moved / "checkpoints" / "step-000001", moved / "checkpoints" / "step-000002"]
    assert state.mlflow_run_id == "def" and f"{moved} was moved from {copy}" in caplog.text
    # an earlier release started from the runs root's parent wrote them relative to it
    RunDir(moved).update_state(checkpoints=["runs/r/checkpoints/step-000001"])
    assert RunDir(moved).checkpoints() == [moved / "checkpoints" / "step-000001"]


@pytest.mark.parametrize("entry", ["../other/checkpoints/step-000002", "/etc", "checkpoints/../../x"])
def test_a_checkpoint_entry_that_leaves_the_run_folder_is_refused_and_named(capsys, run, entry):
    from cluster.runtime import RunDir

    RunDir(run).update_state(checkpoints=[entry])
    assert_refused(*cli(capsys, "train", "--resume", run), f"lists checkpoint {entry!r}, which is outside the run "
                   "folder; a run reads and deletes only its own files")


SECRET_URI = "http://alice:PASSWORD@127.0.0.1:9/"


def test_config_prints_a_tracking_uri_without_its_password():
    code, out = cli_process("config", f"tracking.uri={SECRET_URI}")
    assert code == 0, out
    assert "uri: http://alice:***@127.0.0.1:9/" in out and "PASSWORD" not in out


def test_resume_of_a_run_whose_store_had_a_password_says_how_to_give_it_again(capsys, monkeypatch, runs,
                                                                              tiny_model_dir):
    """config.yaml keeps `alice:***@`: a resume without the password is refused in one line before anything starts;
    MLFLOW_TRACKING_PASSWORD, or the URI given again (the same store: no change), supply it; `exgrpo track --replay`
    says the same."""
    from cluster.run import _reopen
    from cluster.runtime import RunDir
    from common.config import load_config

    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    cfg = load_config(None, [f"checkpoint.runs_root={runs}", "name=r", f"model.path={tiny_model_dir}",
                             "data.task=arithmetic", "reward.name=arithmetic", "data.num_train=50", "total_steps=4",
                             f"tracking.uri={SECRET_URI}"])
    run = RunDir.create(cfg).path
    RunDir(run).update_state(checkpoints=[str(make_checkpoint(run, 1))], status="KILLED", step=1)
    (run / "metrics-unsent.jsonl").write_text('{"key": "a", "value": 1, "timestamp": 1, "step": 1}\n')
    assert "PASSWORD" not in (run / "config.yaml").read_text() + (run / "state.json").read_text()
    code, out = cli(capsys, "train", "--resume", run)
    assert_refused(code, out, "tracking.uri: http://alice:***@127.0.0.1:9/: its secret was redacted",
                   "set MLFLOW_TRACKING_PASSWORD=<the password>, or pass tracking.uri=<the URI with it>")
    assert len(out.strip().splitlines()) == 2 and not (run / "logs").exists()  # the heading and the line
    code, out = cli(capsys, "track", "--replay", run)
    assert_refused(code, out, "error: tracking.uri: http://alice:***@127.0.0.1:9/: its secret was redacted")
    assert _reopen(str(run), [f"tracking.uri={SECRET_URI}"])[1].tracking.uri == SECRET_URI
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "PASSWORD")
    assert _reopen(str(run), [])[1].tracking.uri == SECRET_URI
    assert "PASSWORD" not in (run / "config.yaml").read_text()
    # a new run may be given the password that way too, off its command line; without it, refused before anything
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    assert_refused(*train(capsys, runs, "name=new", "tracking.enabled=true", "tracking.uri=http://alice:***@h:9/"),
                   "tracking.uri: http://alice:***@h:9/: its secret was redacted")
    assert not (runs / "new").exists()


# ------------------------------------------------------------------------------------------ scale, eval


def test_scale_of_a_finished_run_says_it_ended(capsys, run):
    (run / "ray_address").write_text("127.0.0.1:1")
    assert_refused(*cli(capsys, "scale", "--run", "r", "--runs-root", run.parent, "--generators", "2"),
                   "run 'r' is not running: it ended (KILLED at step 2)", f"exgrpo train --resume {run}")
    assert_refused(*cli(capsys, "scale", "--run", "r", "--runs-root", run.parent, "--generators", "-1"),
                   "--generators: -1 is less than 0")


def test_eval_refuses_bad_arguments_and_points_at_the_model_inside_a_checkpoint(capsys, run, tmp_path,
                                                                                 tiny_model_dir):
    ckpt = run / "checkpoints" / "step-000002"
    assert_refused(*cli(capsys, "eval", "--model", ckpt), "--model:",
                   f"did you mean {ckpt / 'learner' / 'model'}?")
    assert_refused(*cli(capsys, "eval", "--model", run), "--model:", "it is a run folder: did you mean its newest "
                   f"checkpoint's model, {ckpt / 'learner' / 'model'}?")
    assert_refused(*cli(capsys, "eval", "--model", tiny_model_dir, "--samples", "0"), "--samples: 0 is less than 1")
    notok = model_copy(tiny_model_dir, tmp_path / "notok", ("tokenizer.json", "tokenizer_config.json"))
    assert_refused(*cli(capsys, "eval", "--model", notok), "--model:", "has no tokenizer files")


# ------------------------------------------------------------------------------------- as a user would


def test_cli_processes_answer_bad_input_without_a_traceback(tmp_path, run):
    assert_refused(*cli_process("train", "name=../../x", f"checkpoint.runs_root={tmp_path / 'runs'}"),
                   "name: '../../x' is not a run name")
    assert not (tmp_path.parent / "x").exists()
    assert_refused(*cli_process("config", "buffer.group_size", "8"), "did you mean buffer.group_size=8?")
    assert_refused(*cli_process("train", "--resume", run, "buffer.group_size=4"),
                   "buffer.group_size cannot change on resume")
    (run / "state.json").write_text("[")
    assert_refused(*cli_process("train", "--resume", run), "state.json is corrupt")


# --------------------------------------------------------------------------------------------- MLflow


def test_mlflow_artifacts_stay_under_the_runs_root(tmp_path, monkeypatch):
    from cluster.tracking import Tracker, default_tracking_uri

    cwd, root = tmp_path / "cwd", tmp_path / "runs"
    cwd.mkdir()
    root.mkdir()
    monkeypatch.chdir(cwd)
    tracker = Tracker(default_tracking_uri(root), "exp")
    tracker.start("r")
    tracker.log_text("total_steps: 1\n", "config.yaml")
    tracker.finish()
    assert list(cwd.iterdir()) == []
    assert (root / "mlartifacts" / "exp" / tracker.run_id / "artifacts" / "config.yaml").is_file()


def test_lengths_the_model_cannot_hold_are_refused_or_fitted(capsys, runs, tmp_path, tiny_model_dir):
    """max_new_tokens at or above the model's positions is refused before the run folder exists; a prompt cap
    that the positions cannot hold with the response is lowered, and vLLM's max_model_len follows it."""
    from cluster.preflight import BadInput
    from cluster.run import fit_lengths
    from common.config import load_config

    limit = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    assert_refused(*train(capsys, runs, f"model.path={tiny_model_dir}", "data.task=arithmetic",
                          f"generator.max_new_tokens={limit}"),
                   f"generator.max_new_tokens: {limit} tokens do not fit {tiny_model_dir}'s {limit} positions (the "
                   f"prompt included); set it below {limit}, or give the model more", "exgrpo extend-context")
    assert not (runs / "r").exists()
    cfg = load_config(None, ["data.task=arithmetic", "generator.max_new_tokens=100", "data.max_prompt_tokens=4096",
                             "generator.engine.kind=vllm"])
    fitted = fit_lengths(cfg, tiny_model_dir)
    assert fitted.data.max_prompt_tokens == limit - 100 and fitted.generator.engine.max_model_len == limit
    auto = fit_lengths(load_config(None, ["data.task=arithmetic", "data.max_prompt_tokens=64"]), tiny_model_dir)
    assert auto.generator.engine.vllm.max_model_len == 64 + auto.generator.max_new_tokens
    with pytest.raises(BadInput, match=r"generator.engine.max_model_len: 32 cannot hold .* raise it to 88"):
        fit_lengths(load_config(None, ["data.task=arithmetic", "data.max_prompt_tokens=64", "generator.max_new_tokens=24",
                                       "generator.engine.kind=vllm", "generator.engine.max_model_len=32"]),
                    tiny_model_dir)


# ------------------------------------------------------------------ exgrpo config and exgrpo train: one preflight


def _not_creatable(tmp_path: Path) -> Path:
    """A runs_root whose parent refuses a new folder (root ignores permission bits: /sys refuses it anyway)."""
    import os

    if os.geteuid() == 0:
        return Path("/sys/exgrpo-runs")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return locked / "runs"


def _setup(case: str, tmp_path: Path, model: Path) -> tuple[list[str], str]:
    """The overrides of one of the seven inputs `exgrpo config` used to accept and `exgrpo train` refused, and
    the words both now answer with."""
    import gzip

    rows = "".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4))
    data = tmp_path / "train.jsonl"
    data.write_text(rows)
    runs = tmp_path / "runs"
    if case == "runs_root is a file":
        (tmp_path / "file").write_text("")
        return [f"checkpoint.runs_root={tmp_path / 'file'}"], "is a file, not a folder"
    if case == "runs_root cannot be created":
        return [f"checkpoint.runs_root={_not_creatable(tmp_path)}"], "checkpoint.runs_root: cannot create"
    if case == "name= a run that exists":
        (runs / "r").mkdir(parents=True)
        (runs / "r" / "state.json").write_text('{"name": "r", "checkpoints": []}')
        return [], "already holds a run; pass name=<new name>"
    if case == "a tokenizer folder that does not load":
        broken = model_copy(model, tmp_path / "no-tokenizer-json", ("tokenizer.json",))
        return [f"model.path={broken}"], "the tokenizer in"
    if case == "use_chat_template without a template":
        return ["data.use_chat_template=true"], "data.use_chat_template is set but the tokenizer has no chat template"
    if case == "every prompt above max_prompt_tokens":
        return ["data.max_prompt_tokens=2"], "(4 of them with a prompt over data.max_prompt_tokens=2)"
    if case == "a .jsonl.gz data file":
        gz = tmp_path / "train.jsonl.gz"
        gz.write_bytes(gzip.compress(rows.encode()))
        return [f"data.train_path={gz}"], "a compressed file (.gz); data files are read uncompressed"
    raise AssertionError(case)


def _args(tmp_path: Path, model: Path, overrides: list[str]) -> list[str]:
    """A run of the tiny model on the data file, with `overrides` in place of the defaults they name."""
    args = dict(a.split("=", 1) for a in [
        f"checkpoint.runs_root={tmp_path / 'runs'}", "tracking.enabled=false", "name=r", f"model.path={model}",
        f"data.train_path={tmp_path / 'train.jsonl'}", "reward.name=exact", *overrides])
    return [f"{k}={v}" for k, v in args.items()]


SEVEN = ["runs_root is a file", "runs_root cannot be created", "name= a run that exists",
         "a tokenizer folder that does not load", "use_chat_template without a template",
         "every prompt above max_prompt_tokens", "a .jsonl.gz data file"]


@pytest.mark.parametrize("case", SEVEN)
def test_config_refuses_what_train_refuses_at_its_start(capsys, tmp_path, tiny_model_dir, case):
    """Issue 51: each of these passed `exgrpo config` (rc 0) and stopped `exgrpo train` at its start. Both run
    `cluster.preflight.check_start`: both refuse, with the same words, and nothing is created."""
    from cluster.console import setup_logging

    setup_logging(None)  # the console handler on this test's stderr (an earlier test's train left one on its own)
    overrides, says = _setup(case, tmp_path, tiny_model_dir)
    args = _args(tmp_path, tiny_model_dir, overrides)
    code, out = cli(capsys, "config", *args)
    assert_refused(code, out, "exgrpo train refuses this config on this machine", says)
    before = sorted(tmp_path.rglob("*"))
    assert_refused(*cli(capsys, "train", *args), says)
    assert sorted(tmp_path.rglob("*")) == before  # no run folder, no runs_root


def test_what_config_accepts_train_starts_from(capsys, tmp_path, tiny_model_dir):
    """The other half: the same inputs without their fault pass `exgrpo config`, and train's start (everything
    before Ray) makes its run folder and loads the questions."""
    from cluster.run import _prepare
    from common.config import load_config

    _setup("every prompt above max_prompt_tokens", tmp_path, tiny_model_dir)  # writes the data file
    args = _args(tmp_path, tiny_model_dir, [])
    code, out = cli(capsys, "config", *args)
    assert code == 0, out
    cfg, run_dir, _, model_path, questions = _prepare(load_config(None, args), None, [])
    assert run_dir.path == tmp_path / "runs" / "r" and model_path == tiny_model_dir and len(questions) == 4


# ------------------------------------------------------------------ exgrpo eval: the start checks of train


def _plain_rows(path: Path) -> Path:
    """Questions with whole-number answers: your own data, not the countdown task's."""
    path.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    return path


@pytest.mark.parametrize("args", [["reward.name=exact"], ["--task", "arithmetic"], ["reward.name=math"],
                                  ["--task", "arithmetic", "reward.name=exact"]])
def test_eval_of_your_own_file_with_your_own_reward_runs_as_written(capsys, tmp_path, tiny_model_dir, args):
    """--data is the data of every check: the config is no longer checked against the default countdown task
    first ("exact cannot score the countdown task"). --task with --data: the file in that task's format."""
    data = _plain_rows(tmp_path / "plain.jsonl")
    code, out = cli(capsys, "eval", "--model", tiny_model_dir, "--data", data, "--limit", "2", "--samples", "1", *args,
                    "generator.engine.kind=transformers", "tracking.enabled=false")
    assert code == 0, out
    assert "greedy accuracy" in out and "cannot score" not in out, out


def _bad_input(case: str, tmp_path: Path, model: Path) -> tuple[Path, Path, list[str], str]:
    """(model folder, data file, overrides) of one input `train` refuses at its start, and the words of the refusal
    after its field name (train names model.path and data.train_path, eval --model and --data)."""
    import gzip

    data = _plain_rows(tmp_path / "plain.jsonl")
    if case == "the countdown reward on your own data":
        return model, data, ["reward.name=countdown"], ("reward.name: countdown cannot read the reference answers of "
                                                        f"{{data}} {data} (its first rows have '1', '2', '3'")
    if case == "a response longer than the model's positions":
        long = model_copy(model, tmp_path / "short", config=json.dumps(
            {**json.loads((model / "config.json").read_text()), "max_position_embeddings": 4096}))
        return long, data, ["generator.max_new_tokens=8192"], (f"generator.max_new_tokens: 8192 tokens do not fit "
                                                                f"{long}'s 4096 positions (the prompt included)")
    if case == "weights cut short":
        short = model_copy(model, tmp_path / "cut")
        w = short / "model.safetensors"
        size = w.stat().st_size
        w.write_bytes(w.read_bytes()[: size // 2])
        return short, data, [], f"{{model}}: {w} is cut short: its header says {size} bytes, the file has {size // 2}"
    if case == "a reward module that does not import":
        return model, data, ["reward.name=nopkg.nomod:fn"], "reward.name: cannot import module 'nopkg.nomod'"
    if case == "a compressed data file":
        gz = tmp_path / "plain.jsonl.gz"
        gz.write_bytes(gzip.compress(data.read_bytes()))
        return model, gz, [], f"{{data}}: {gz}: a compressed file (.gz); data files are read uncompressed"
    if case == "a config.json vocabulary the weights do not hold":
        other = model_copy(model, tmp_path / "vocab", config=json.dumps(
            {**json.loads((model / "config.json").read_text()), "vocab_size": 163}))
        return other, data, [], f"{{model}}: {other / 'config.json'} says vocab_size 163, but the weights hold 99 rows"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["the countdown reward on your own data", "a response longer than the model's positions",
                                  "weights cut short", "a reward module that does not import", "a compressed data file",
                                  "a config.json vocabulary the weights do not hold"])
def test_train_and_eval_refuse_the_same_bad_inputs(capsys, tmp_path, tiny_model_dir, case):
    """`exgrpo eval` runs the start checks `train` runs, for the model and the data it uses: the same words."""
    model, data, overrides, says = _bad_input(case, tmp_path, tiny_model_dir)
    assert_refused(*train(capsys, tmp_path / "runs", f"model.path={model}", f"data.train_path={data}",
                          "reward.name=exact", *overrides),
                   says.format(model="model.path", data="data.train_path"))
    assert not (tmp_path / "runs" / "r").exists()
    assert_refused(*cli(capsys, "eval", "--model", model, "--data", data, "reward.name=exact", *overrides,
                        "generator.engine.kind=transformers", "tracking.enabled=false"),
                   says.format(model="--model", data="--data"))


def test_the_built_in_model_on_your_own_data_is_named_in_one_line(capsys, tmp_path, tiny_model_dir, caplog):
    """No model.path with your own data: the run would train the built-in countdown model on it; one line says so
    and how to give your own. With data.task=null there is no built-in model: refused."""
    import logging

    data = _plain_rows(tmp_path / "plain.jsonl")
    with caplog.at_level(logging.WARNING, logger="exgrpo"):
        code, out = cli(capsys, "config", f"data.train_path={data}", "reward.name=exact")
    says = [r.getMessage() for r in caplog.records if "model.path is not set" in r.getMessage()]
    assert says == [f"model.path is not set: this run trains the built-in countdown model (a small model with a "
                    f"character tokenizer, built for the countdown task) on data.train_path={data}; set "
                    "model.path=<your model folder> to train your own (docs/own-task.md, section 1)"], out
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="exgrpo"):
        code, out = cli(capsys, "config", f"data.train_path={data}", "reward.name=exact", f"model.path={tiny_model_dir}")
    assert code == 0 and not [r for r in caplog.records if "model.path is not set" in r.getMessage()], out
    code, out = cli(capsys, "config", f"data.train_path={data}", "reward.name=exact", "data.task=null")
    assert code == 2 and "model.path: not set, and with data.task=null there is no built-in model" in out, out
