"""Checks of a run's inputs, made before anything is created or started: the run folder, the model folder and
its tokenizer, the reward function, the data, and a run checkpoint to resume from.

`check_start(cfg)` is the one start check: `exgrpo train` runs it before it creates the run folder and uses what
it returns (the fitted config, the model folder, the training questions); `exgrpo config` runs the same, so that
its exit code 0 means `train` gets past its start.

Each check answers with a message that names what to change (`model.path: ... has no tokenizer files;
copy ...`), never with a library's traceback. `BadInput` carries such a message to the CLI, which prints
it and exits with code 2.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cluster import input_checks
from common.text import one_line

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer_config.json")
"""Any of these makes a folder worth handing to AutoTokenizer (which explains itself badly when none exist)."""

HUB_ID = re.compile(r"([A-Za-z0-9][\w.-]*)/([A-Za-z0-9][\w.-]*)")
"""`Qwen/Qwen2.5-0.5B-Instruct`: an organisation and a model name, the form of a Hugging Face hub id."""

log = logging.getLogger("exgrpo")

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


class BadInput(Exception):
    """Input that cannot work. `str()` is the heading and one indented line per problem."""

    def __init__(self, heading: str, *lines: str):
        super().__init__("\n  ".join([heading, *lines]))
        self.heading, self.lines = heading, list(lines)


def model_folder_problem(path: Path, field: str = "model.path") -> str | None:
    """Why `path` is not a usable Hugging Face model folder (None when it is): config.json present and
    readable, weights present, tokenizer files present."""
    if not path.exists():
        hub = HUB_ID.fullmatch(str(path))
        if hub:
            folder = f"models/{hub.group(2)}"
            return (f"{field}: {path} does not exist here; it looks like a Hugging Face hub id, and runs load a folder "
                    f"and never download: download it first (.venv/bin/hf download {path} --local-dir {folder}) "
                    f"and set {field}={folder}")
        return f"{field}: {path} does not exist, so it is not a Hugging Face model folder{_nearby_model(path)}"
    if not path.is_dir():
        return f"{field}: {path} is not a Hugging Face model folder (no config.json){_nearby_model(path)}"
    config = path / "config.json"
    if not config.is_file():
        return f"{field}: {path} is not a Hugging Face model folder (no config.json){_nearby_model(path)}"
    try:
        d = json.loads(config.read_text())
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"{field}: {config} is not readable JSON ({e}); restore it from where the model came from"
    if not isinstance(d, dict) or "model_type" not in d:
        return f"{field}: {config} has no model_type; it is not a transformers model config"
    if not any(next(path.glob(p), None) for p in WEIGHT_PATTERNS):
        return f"{field}: {path} has no weights (*.safetensors or *.bin); copy them into the folder"
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return (f"{field}: {path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...); copy the "
                "tokenizer of the model it was made from into the folder (tokenizer.save_pretrained(path))")
    return None


def model_max_positions(path: Path) -> int | None:
    """The model's max_position_embeddings from its config.json (None when it does not say)."""
    try:
        d = json.loads((path / "config.json").read_text())
    except (ValueError, OSError):
        return None  # model_folder_problem reports an unreadable config
    limit = d.get("max_position_embeddings") if isinstance(d, dict) else None
    return limit if isinstance(limit, int) and limit > 0 else None


def _nearby_model(path: Path) -> str:
    """A hint when `path` is a run folder, a run checkpoint (or its learner folder) rather than the model inside it."""
    if (path / "state.json").is_file():  # a run folder: its newest checkpoint's model (by name, inside the folder)
        try:
            listed = json.loads((path / "state.json").read_text()).get("checkpoints") or []
        except (OSError, ValueError, AttributeError):
            listed = []
        newest = path / "checkpoints" / Path(str(listed[-1])).name if listed else None
        if newest is not None and (newest / "learner" / "model" / "config.json").is_file():
            return f"; it is a run folder: did you mean its newest checkpoint's model, {newest / 'learner' / 'model'}?"
        return "; it is a run folder with no checkpoint yet (no model to load)"
    for sub in ("learner/model", "model"):
        if (path / sub / "config.json").is_file():
            return f"; did you mean {path / sub}?"
    return ""


def load_tokenizer(path: Path, field: str = "model.path"):
    """The folder's tokenizer; BadInput (not a transformers traceback) when it cannot be built."""
    from common.tokenizer import auto_tokenizer

    try:
        return auto_tokenizer(path)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        # a library's multi-line message as one line (transformers ends "... one of:" and lists on the next lines)
        why = one_line(str(e), 600) or type(e).__name__
        raise BadInput("invalid configuration:", f"{field}: the tokenizer in {path} cannot be loaded "
                       f"({why}); copy the tokenizer files of the model it was made from into the folder "
                       "(tokenizer.json with tokenizer_config.json: tokenizer.save_pretrained(path))") from None


def check_reward(reward_name: str, task: str | None) -> None:
    """The reward resolves here as it will in the generators (a user module imports, the function
    exists) and can score the task; BadInput otherwise."""
    from common.reward_registry import check_task_matches, resolve_reward

    try:
        resolve_reward(reward_name)
        check_task_matches(reward_name, task)
    except ValueError as e:
        raise BadInput("invalid configuration:", str(e)) from None


def experience_policy_problem(buffer_cfg) -> str:
    """A user's experience policy (buffer.experience_policy) imports and builds here as it will in every shard; ""
    when it does (or none is named)."""
    if not buffer_cfg.experience_policy:
        return ""
    from buffer.experience_policy import make_experience_policy

    try:
        make_experience_policy(buffer_cfg)
    except ValueError as e:
        return str(e)
    except Exception as e:  # the user's constructor: say what it raised, not a traceback
        return (f"buffer.experience_policy: building {buffer_cfg.experience_policy}(buffer config) raised "
                f"{type(e).__name__}: {one_line(str(e), 600)}; fix its __init__")
    return ""


def user_modules(cfg) -> list[str]:
    """The user's modules (reward.name, eval.sets.<name>.reward, buffer.experience_policy) that are not installed: for
    each, the module file or its top-level package folder, found on sys.path outside site-packages and outside this
    project's source. The run gives them to Ray as the runtime_env's `py_modules`, so Ray uploads them and puts them on the
    path of every worker on every node (a reward module in the folder the run starts from reaches the generators
    of every node). Ray's upload limit applies (a package folder of data is better installed on the nodes)."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    names = [cfg.reward.name, *(s.reward for s in cfg.eval.sets.values() if s.reward),
             cfg.buffer.experience_policy or ""]
    found = []
    for name in names:
        if ":" not in name:
            continue
        top = name.partition(":")[0].split(".")[0]
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue  # the start checks report it
        if spec is None:
            continue
        if spec.submodule_search_locations:  # a package (or namespace package): its folder
            path = Path(next(iter(spec.submodule_search_locations)))
        elif spec.origin and spec.origin.endswith(".py"):
            path = Path(spec.origin)
        else:
            continue  # built-in or compiled: installed, nothing to ship
        path = path.resolve()
        if {"site-packages", "dist-packages"} & set(path.parts) or (path.is_dir() and path.is_relative_to(root)):
            continue  # installed, or one of this project's packages (installed with it on every node)
        if str(path) not in found:
            found.append(str(path))
    return found


def input_problems(cfg) -> list[str]:
    """The quick part of the start checks (`check_start`), as "field: problem" lines, all of them at once (no
    model is built or loaded, no data file read whole): the model folder and its positions, the data files, the
    reward (it imports, it can score the task, it can read the first answers)."""
    problems = []
    if cfg.model.path is not None:
        problems.append(model_folder_problem(Path(cfg.model.path).expanduser()))
    elif cfg.data.task is None:
        problems.append("model.path: not set, and with data.task=null there is no built-in model (each is built for "
                        "its built-in task); set model.path=<your model folder> (docs/own-task.md, section 1)")
    problems += data_and_reward_problems(cfg)
    problems.append(experience_policy_problem(cfg.buffer))
    problems.extend(input_checks.problems(cfg))  # the model folder's weights, LoRA targets, cluster.address, ...
    return [p for p in problems if p]


def data_and_reward_problems(cfg, data_field: str | None = None) -> list[str]:
    """The data files, the reward (it imports, it can score the task, it can read the first answers) and the
    response length against the model's positions: what `exgrpo train` and `exgrpo eval` both check.
    `data_field`: the option that gave one file as both splits (`exgrpo eval --data`), named instead."""
    if data_field is None:
        problems = [data_file_problem(getattr(cfg.data, k), f"data.{k}") for k in ("train_path", "test_path")]
    else:
        problems = [data_file_problem(cfg.data.train_path, data_field)]
    try:
        check_reward(cfg.reward.name, cfg.data.task if cfg.data.train_path is None else None)
    except BadInput as e:
        problems.extend(e.lines)
    source = f"{data_field} {cfg.data.train_path}" if data_field else None
    problems.append(answers_problem(cfg.data, cfg.reward.name, source))
    problems.append(_response_too_long(cfg))
    return [p for p in problems if p]


def eval_problems(cfg, model: Path, use_sets: bool, data_field: str | None = None) -> list[str]:
    """The start checks of `exgrpo eval --model model`, as `input_problems` makes them for `train`: the data and
    reward it evaluates (each of eval.sets with its own reward when `use_sets`), the response length and the model
    folder's weights (`cfg.model.path` is `model`)."""
    problems = input_checks.model_problems(model, "--model")
    if not use_sets:
        return problems + data_and_reward_problems(cfg, data_field)
    problems.append(_response_too_long(cfg))
    for name, st in cfg.eval.sets.items():
        reward = st.reward or cfg.reward.name
        problems.append(data_file_problem(st.path, f"eval.sets.{name}.path"))
        try:
            check_reward(reward, None)
        except BadInput as e:
            problems.extend(e.lines)
        problems.append(answers_problem(cfg.data.model_copy(update={"train_path": st.path}), reward,
                                        f"eval.sets.{name}.path {st.path}"))
    return [p for p in problems if p]


def data_file_problem(path: str | None, field: str) -> str | None:
    """Why `path` cannot be read as a data file (missing, not JSONL or Parquet, compressed); None when it can
    be opened (its rows are checked when the questions are loaded)."""
    from common.data import DataError, read_rows

    if path is None:
        return None
    if not Path(path).expanduser().is_file():
        return f"{field}: {path} is not a file"
    try:
        read_rows(path)  # checks the format now; the rows are read lazily
    except DataError as e:
        return f"{field}: {e}"
    return None


def run_folder_problem(cfg) -> str | None:
    """Why a new run of `cfg` cannot have its folder (checkpoint.runs_root a file or not writable, `name=` a run
    that exists); None when it can."""
    import tempfile

    if cfg.name is None:  # a new timestamped name: only the runs_root can be in the way
        path = Path(cfg.checkpoint.runs_root).expanduser() / ".exgrpo-new-run"
    else:
        path = Path(cfg.checkpoint.runs_root).expanduser() / cfg.name
    # the checks of cluster.runtime.RunDir.planned, without importing it: that imports ray, and `exgrpo train`
    # must set RAY_AUTH_MODE for its cluster before ray is imported (cluster/cli.py)
    if cfg.name is not None and (path / "state.json").exists():
        return (f"{path} already holds a run; pass name=<new name> or resume it with "
                f"`exgrpo train --resume {path}`")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"checkpoint.runs_root: {existing} is a file, not a folder; point checkpoint.runs_root at a folder"
    try:  # a folder made and removed: what the run will do (permission bits do not tell for root, nor for ACLs)
        os.rmdir(tempfile.mkdtemp(prefix=".exgrpo-check-", dir=existing))
    except OSError as e:
        return (f"checkpoint.runs_root: cannot create {path}: {existing} refuses a new folder ({e.strerror}); point "
                "checkpoint.runs_root at a writable folder")
    return None


@dataclass
class Start:
    """What a run starts from once every input passed `check_start`."""

    cfg: object  # RunConfig, with the prompt and sequence lengths fitted to the model (`fit_lengths`)
    model_path: Path | None  # None: the built-in model is not built yet (`exgrpo config`)
    questions: list | None  # the training questions (None when model_path is None)


def check_start(cfg, *, new_run: bool = True, build_model: bool = True, on_checked=None) -> Start:
    """Every check `exgrpo train` makes before it creates anything, and the one `exgrpo config` makes, so that
    `config` rc 0 means `train` gets past its start: the run folder (`new_run`), the quick input checks (all
    reported at once), then the model's lengths, its tokenizer and the training data (tokenised, as the run
    loads them). `build_model=False` (config): the built-in model is used only when cached (a build takes
    minutes), else the tokenizer and data checks wait for `train`. `on_checked(cfg)` is called once the quick
    checks pass (`train` starts Ray then, beside the rest). BadInput with what to change."""
    problems = [run_folder_problem(cfg) if new_run else None, *input_problems(cfg)]
    problems = [p for p in problems if p]
    if problems:
        raise BadInput("invalid configuration:", *problems)
    if cfg.model.path is None and cfg.data.train_path is not None:
        log.warning("%s", builtin_model_on_own_data(cfg))
    if on_checked is not None:
        on_checked(cfg)
    model_path = resolve_model(cfg, build=build_model)
    if model_path is None:
        return Start(cfg, None, None)
    cfg = fit_lengths(cfg, model_path)
    return Start(cfg, model_path, train_questions(cfg, model_path))


def builtin_model_on_own_data(cfg) -> str:
    """The one line that says a run trains the built-in model (model.path unset) on a data file it was not built
    for, and how to give your own model."""
    return (f"model.path is not set: this run trains the built-in {cfg.data.task} model (a small model with a "
            f"character tokenizer, built for the {cfg.data.task} task) on data.train_path={cfg.data.train_path}; set "
            "model.path=<your model folder> to train your own (docs/own-task.md, section 1)")


def resolve_model(cfg, build: bool = True) -> Path | None:
    """The model folder: model.path, or the built-in model (built once and cached; with `build=False` only
    when cached, else None)."""
    if cfg.model.path is not None:
        path = Path(cfg.model.path).expanduser()
        problem = model_folder_problem(path)
        if problem is not None:
            raise BadInput("invalid configuration:", problem)
        return path
    from common import toy_model

    if build:
        return toy_model.ensure_toy_model(cfg.model, cfg.data, verbose=True)
    if cfg.data.task is None:
        return None
    folder = Path(cfg.model.cache_dir).expanduser() / f"toy-{cfg.data.task}-{toy_model.cache_key(cfg.model.toy, cfg.data)}"
    return folder if (folder / toy_model.INFO_FILE).is_file() else None


def fit_lengths(cfg, model_path: Path):
    """Prompt and sequence lengths that the model's positions hold, resolved once (the saved config carries
    them): data.max_prompt_tokens is lowered to max_position_embeddings - generator.max_new_tokens when
    above it (longer prompts are skipped and counted, as always), and the vLLM engine's max_model_len,
    when None, becomes data.max_prompt_tokens + generator.max_new_tokens. BadInput when the model cannot
    hold max_new_tokens, or a max_model_len set by hand cannot hold a prompt and its response."""
    new, prompt = cfg.generator.max_new_tokens, cfg.data.max_prompt_tokens
    limit = model_max_positions(model_path)
    if limit is not None and new >= limit:
        raise BadInput("invalid configuration:", f"generator.max_new_tokens: {new} does not fit the model's {limit} "
                       f"positions (max_position_embeddings of {model_path}) with any prompt; lower it below {limit}, "
                       "or use a model with longer positions (docs/own-task.md, section 4: exgrpo extend-context)")
    if limit is not None and prompt + new > limit:
        log.info("data.max_prompt_tokens: lowered from %d to %d (the model's %d positions - generator.max_new_tokens "
                 "%d); longer prompts are skipped and counted", prompt, limit - new, limit, new)
        prompt = limit - new
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_prompt_tokens": prompt})})
    engine = cfg.generator.engine
    nested = hasattr(engine, "vllm")  # engine kind auto holds its vLLM settings in .vllm
    vllm_cfg = engine.vllm if nested else engine
    if hasattr(vllm_cfg, "max_model_len"):
        if vllm_cfg.max_model_len is None:
            vllm_cfg = vllm_cfg.model_copy(update={"max_model_len": prompt + new})
            engine = engine.model_copy(update={"vllm": vllm_cfg}) if nested else vllm_cfg
            cfg = cfg.model_copy(update={"generator": cfg.generator.model_copy(update={"engine": engine})})
        elif vllm_cfg.max_model_len < prompt + new:
            raise BadInput("invalid configuration:", f"generator.engine.max_model_len: {vllm_cfg.max_model_len} cannot "
                           f"hold data.max_prompt_tokens + generator.max_new_tokens = {prompt} + {new}; raise it to "
                           f"{prompt + new} or unset it (None derives it)")
    return cfg


def train_questions(cfg, model_path: Path) -> list:
    """The training questions, tokenised as the run uses them; BadInput when none is usable."""
    from common.data import DataError, load_questions

    from cluster.input_checks import tokenizer_vocab_problem

    tokenizer = load_tokenizer(model_path)
    problem = tokenizer_vocab_problem(tokenizer, model_path,
                                      "model.path" if cfg.model.path is not None else "the built-in model")
    if problem is not None:
        raise BadInput("invalid configuration:", problem)
    try:
        questions, report = load_questions(cfg.data, tokenizer, "train", cfg.model.cache_dir)
    except DataError as e:
        raise BadInput("invalid data:", str(e)) from None
    if not questions:
        hint = ([f"data.question_field / data.answer_field name the fields of each row (now {cfg.data.question_field!r} "
                 f"/ {cfg.data.answer_field!r})"] if any("missing field" in p for p in report.problems) else [])
        raise BadInput("invalid data:", f"data: no usable training questions ({report.summary()})",
                       *report.problems[:3], *hint)
    if report.skipped:
        log.warning("data: %s; first problems: %s", report.summary(), "; ".join(report.problems[:5]))
    log.info("data: %s", report.summary())
    for line in data_notes(cfg, len(questions)):
        log.warning("%s", line)
    return questions


def data_notes(cfg, num_questions: int) -> list[str]:
    """What the data makes of the run that its numbers alone do not say: a batch larger than the training set, and
    "held-out" sets that are the training file."""
    notes = []
    if num_questions < cfg.buffer.batch_questions:
        notes.append(f"buffer.batch_questions={cfg.buffer.batch_questions} is more than the {num_questions} training "
                     f"question(s): every batch repeats them (each ~{cfg.buffer.batch_questions // num_questions} "
                     f"times); set buffer.batch_questions at most {num_questions}, or use more data")
    train = cfg.data.train_path and Path(cfg.data.train_path).expanduser().resolve()
    held_out = {"data.test_path": cfg.data.test_path,
                **{f"eval.sets.{name}.path": s.path for name, s in cfg.eval.sets.items()}}
    for field, path in held_out.items():
        if train and path and Path(path).expanduser().resolve() == train:
            notes.append(f"{field} is data.train_path ({cfg.data.train_path}): its numbers are training accuracy, not "
                         "held-out accuracy; point it at a file the run does not train on")
    return notes


def gpus_missing(cfg) -> str | None:
    """GPUs asked of a local run (no cluster.address: Ray starts here with this machine's GPUs) on a machine
    without any: `exgrpo train` refuses it before Ray starts (the placement check would, once Ray is up);
    `exgrpo config` warns (a GPU run's settings are checked on a CPU machine too: scripts/gpu_check.sh)."""
    asked = {f"{s}.num_gpus": getattr(cfg, s).num_gpus for s in ("learner", "generator", "eval")}
    asked = {k: v for k, v in asked.items() if v > 0}
    if not asked or cfg.cluster.address is not None:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    keys = ", ".join(f"{k}={v:g}" for k, v in asked.items())
    return (f"{keys}: GPUs asked of a local run, but this machine has none (torch.cuda.is_available() is False); "
            f"set {' '.join(f'{k}=0' for k in asked)}, or cluster.address to a Ray cluster with GPUs")


def _response_too_long(cfg) -> str | None:
    """generator.max_new_tokens at or beyond the model's positions: no prompt would leave room for a response."""
    new = cfg.generator.max_new_tokens
    if cfg.model.path is None:
        limit, what, fix = cfg.model.toy.max_positions, "the built-in model's", "or raise model.toy.max_positions"
    else:
        path = Path(cfg.model.path).expanduser()
        limit = model_max_positions(path) if path.is_dir() else None
        what, fix = f"{path}'s", ("or give the model more (max_position_embeddings in its config.json: a copy made by "
                                  "`exgrpo extend-context`, docs/own-task.md section 4)")
    if limit is None or new < limit:
        return None
    return (f"generator.max_new_tokens: {new} tokens do not fit {what} {limit} positions (the prompt included); "
            f"set it below {limit}, {fix}")


ANSWERS_CHECKED = 20
"""Rows of data.train_path whose reference answers `answers_problem` gives to the reward's parser."""


def answers_problem(data, reward_name: str, source: str | None = None) -> str | None:
    """Why the reward cannot read the reference answers of data.train_path's first rows (None: it reads one of
    them, the reward reads any text, or there is no readable file: the data checks report that)."""
    from common.data import DataError, read_rows
    from common.reward_registry import unreadable_answers

    if data.train_path is None:
        return None
    answers = []
    try:
        for _, row in read_rows(data.train_path):
            value = row.get(data.answer_field) if isinstance(row, dict) else None
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                answers.append(str(value))
            if len(answers) == ANSWERS_CHECKED:
                break
    except (DataError, OSError, ValueError):
        return None
    return unreadable_answers(reward_name, answers, source or f"data.train_path {data.train_path}")


# ------------------------------------------------------------------------------------ checkpoints


def checkpoint_problem(ckpt: Path, num_shards: int) -> str | None:
    """Why a run checkpoint (`driver.json`, `learner/`, `buffer/`) cannot be resumed from; None when it
    can. Reads the small files whole, the weights' header and every optimizer entry as the learner would, with no
    code run (`learner.checkpoint.check_dcp_folder`: a planted pickle is a problem naming its file); buffer
    snapshots are checksummed."""
    if not ckpt.is_dir():
        return "the folder is missing"
    return _driver_problem(ckpt / "driver.json") or _learner_problem(ckpt / "learner") or _buffer_problem(
        ckpt / "buffer", num_shards)


def _driver_problem(path: Path) -> str | None:
    from cluster.state import DriverState

    try:
        DriverState(**json.loads(path.read_text()))
    except FileNotFoundError:
        return "driver.json is missing"
    except (ValueError, TypeError) as e:
        return f"driver.json is corrupt ({type(e).__name__}: {e})"
    return None


def _learner_problem(path: Path) -> str | None:
    from safetensors import SafetensorError, safe_open

    from learner import checkpoint as ck

    try:
        ck.read_meta(path)
        ck.check_dcp_folder(path / ck.OPTIM_DIR)
    except ck.CheckpointError as e:
        return str(e)
    weights = path / ck.MODEL_DIR / "model.safetensors"
    try:
        with safe_open(str(weights), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        return f"model weights {weights} are unreadable ({e})"
    for rng in sorted((path / ck.RNG_DIR).glob("*.json")):
        try:
            json.loads(rng.read_text())
        except ValueError as e:
            return f"RNG state {rng} is corrupt ({e})"
    return None


def _buffer_problem(path: Path, num_shards: int) -> str | None:
    from buffer.client import SWITCH_FILE
    from buffer.shard import unpack
    from buffer.snapshot import SnapshotError, check_snapshot

    try:
        unpack((path / SWITCH_FILE).read_bytes())
    except FileNotFoundError:
        return f"{path / SWITCH_FILE} is missing"
    except ValueError as e:  # msgpack's errors are ValueErrors
        return f"{path / SWITCH_FILE} is corrupt ({e})"
    for shard in range(num_shards):
        try:
            check_snapshot(path, shard)
        except SnapshotError as e:
            return str(e)
    return None
