"""Checks of a run's inputs, made before anything is created or started: the model folder and its
tokenizer, the reward function, and a run checkpoint to resume from.

Each check answers with a message that names what to change (`model.path: ... has no tokenizer files;
copy ...`), never with a library's traceback. `BadInput` carries such a message to the CLI, which prints
it and exits with code 2.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from cluster import input_checks

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer_config.json")
"""Any of these makes a folder worth handing to AutoTokenizer (which explains itself badly when none exist)."""

HUB_ID = re.compile(r"([A-Za-z0-9][\w.-]*)/([A-Za-z0-9][\w.-]*)")
"""`Qwen/Qwen2.5-0.5B-Instruct`: an organisation and a model name, the form of a Hugging Face hub id."""

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


class BadInput(Exception):
    """Input that cannot work. `str()` is the heading and one indented line per problem."""

    def __init__(self, heading: str, *lines: str):
        super().__init__("\n  ".join([heading, *lines]))


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
    """A hint when `path` is a run checkpoint (or its learner folder) rather than the model inside it."""
    for sub in ("learner/model", "model"):
        if (path / sub / "config.json").is_file():
            return f"; did you mean {path / sub}?"
    return ""


def load_tokenizer(path: Path, field: str = "model.path"):
    """The folder's tokenizer; BadInput (not a transformers traceback) when it cannot be built."""
    from common.tokenizer import auto_tokenizer

    try:
        return auto_tokenizer(path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BadInput("invalid configuration:", f"{field}: the tokenizer in {path} cannot be loaded ({first}); "
                       "copy the tokenizer files of the model it was made from into the folder") from None


def check_reward(reward_name: str, task: str | None) -> None:
    """The reward resolves here as it will in the generators (a user module imports, the function
    exists) and can score the task; BadInput otherwise."""
    from common.reward_registry import check_task_matches, resolve_reward

    try:
        resolve_reward(reward_name)
        check_task_matches(reward_name, task)
    except ValueError as e:
        raise BadInput("invalid configuration:", str(e)) from None


def input_problems(cfg) -> list[str]:
    """What `exgrpo train` would refuse at start on this machine, as "field: problem" lines (no model is built
    or loaded): the model folder, the data files, and a user reward that must import."""
    from common.reward_registry import BUILTIN_NAMES, resolve_reward

    problems = []
    if cfg.model.path is not None:
        problems.append(model_folder_problem(Path(cfg.model.path).expanduser()))
    for key in ("train_path", "test_path"):
        p = getattr(cfg.data, key)
        if p is not None and not Path(p).expanduser().is_file():
            problems.append(f"data.{key}: {p} is not a file")
    if cfg.reward.name not in BUILTIN_NAMES and ":" in cfg.reward.name:
        try:
            resolve_reward(cfg.reward.name)
        except ValueError as e:
            problems.append(str(e))
    problems.append(answers_problem(cfg.data, cfg.reward.name))
    problems.append(_response_too_long(cfg))
    problems.extend(input_checks.problems(cfg))  # the model folder's vocabulary, LoRA targets, cluster.address
    return [p for p in problems if p]


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
        what, fix = f"{path}'s", "or use a model with more (max_position_embeddings in its config.json)"
    if limit is None or new < limit:
        return None
    return (f"generator.max_new_tokens: {new} tokens do not fit {what} {limit} positions (the prompt included); "
            f"set it below {limit}, {fix}")


ANSWERS_CHECKED = 20
"""Rows of data.train_path whose reference answers `answers_problem` gives to the reward's parser."""


def answers_problem(data, reward_name: str) -> str | None:
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
    return unreadable_answers(reward_name, answers, f"data.train_path {data.train_path}")


# ------------------------------------------------------------------------------------ checkpoints


def checkpoint_problem(ckpt: Path, num_shards: int) -> str | None:
    """Why a run checkpoint (`driver.json`, `learner/`, `buffer/`) cannot be resumed from; None when it
    can. Reads the small files whole and the weights' header; buffer snapshots are checksummed."""
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
