"""The `data` section and the built-in tasks' defaults (TASK_DEFAULTS)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from common.config.base import Section


class DataConfig(Section):
    """Where questions come from: a built-in task or a JSONL/Parquet file."""

    task: Literal["countdown", "arithmetic", "think_arith"] | None = "countdown"
    """Built-in task generated from `seed` (common/tasks.py). Ignored when `train_path` is set. A task also
    sets the fields of its TASK_DEFAULTS that the config leaves out: `think_arith` (expressions with a
    `<think>` reasoning block, the authors' ExGRPO format) sets reward.name=math_think,
    data.use_chat_template=true (its built-in model is a BPE chat model), generator.max_new_tokens=40 and the
    built-in model's size and weak-start recipe; `arithmetic` sets reward.name=arithmetic."""
    train_path: str | None = None
    """JSONL or Parquet file of training questions; overrides `task`."""
    test_path: str | None = None
    """Held-out JSONL or Parquet file for evaluation, beside `train_path` (a built-in task makes its own test
    split, so without `train_path` it is refused; `eval.sets` evaluates a file beside a built-in task)."""
    question_field: str = Field("question", min_length=1)
    """Field holding the question text."""
    answer_field: str = Field("answer", min_length=1)
    """Field holding the reference answer."""
    id_field: str | None = "id"
    """Optional field holding a stable question id; absent ids are derived from the content."""
    use_chat_template: bool = False
    """Wrap each question with the tokenizer's chat template (with the built-in model: true exactly for a chat
    task, `think_arith`)."""
    system_prompt: str | None = None
    """A system message put before every question (chat template only)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables passed to `apply_chat_template` (chat template only), e.g. Qwen3's
    `{enable_thinking: false}`."""
    chat_template_path: str | None = None
    """A Jinja chat template file used instead of the tokenizer's own (chat template only)."""
    max_prompt_tokens: int = Field(1024, ge=1, le=1_000_000)
    """Longer prompts are skipped and counted."""
    max_question_chars: int = Field(100_000, ge=1)
    """Rows with a longer question or answer are skipped and counted."""
    strict: bool = False
    """Reject the whole file on the first bad row instead of skipping bad rows."""
    num_train: int = Field(2000, ge=1, le=10_000_000)
    """Questions generated for a built-in task's training split."""
    num_test: int = Field(200, ge=1, le=1_000_000)
    """Questions generated for a built-in task's held-out split."""
    seed: int = Field(0, ge=0, le=2**32 - 1)  # numpy and vLLM take 32-bit seeds
    """Seed of the built-in task generator."""

    @model_validator(mode="after")
    def _chat_settings_need_the_template(self) -> DataConfig:
        given = [k for k in ("system_prompt", "chat_template_path") if getattr(self, k) is not None]
        given += ["chat_template_kwargs"] if self.chat_template_kwargs else []
        if given and not self.use_chat_template:
            raise ValueError(f"{', '.join('data.' + k for k in given)} only apply to the chat template; set "
                             "data.use_chat_template=true")
        if self.chat_template_path is not None and not Path(self.chat_template_path).expanduser().is_file():
            raise ValueError(f"data.chat_template_path: {self.chat_template_path} is not a file")
        return self

    @model_validator(mode="after")
    def _fields_apart(self) -> DataConfig:
        """One field of a row per role: a question field that is the answer field makes every prompt its own
        reference answer; an id field that is either makes ids repeat (rows skipped as duplicates)."""
        if self.question_field == self.answer_field:
            raise ValueError(f"data.question_field and data.answer_field both name {self.question_field!r}: every "
                             "prompt would be its own reference answer; set data.question_field to the field holding "
                             "the question text (default question)")
        same = [k for k in ("question_field", "answer_field") if getattr(self, k) == self.id_field]
        if same:
            raise ValueError(f"data.id_field and data.{same[0]} both name {self.id_field!r}: rows with the same "
                             f"{same[0].removesuffix('_field')} would be skipped as duplicate ids; set data.id_field "
                             "to a field holding a unique id, or null to derive ids from the content")
        return self


TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "countdown": {"reward.name": "countdown"},
    "arithmetic": {"reward.name": "arithmetic"},
    "think_arith": {
        "reward.name": "math_think",
        "data.use_chat_template": True,
        "generator.max_new_tokens": 40,
        "model.toy.hidden_size": 64,  # 143k parameters: its RL steps stay at seconds on 2 CPUs
        "model.toy.num_heads": 2,
        "model.toy.num_layers": 2,
        "model.toy.batch_size": 64,
        "model.toy.target_mean_accuracy": 0.15,  # the weak start: most questions solved rarely
        "model.toy.eval_every": 100,
        "model.toy.max_train_steps": 5000,
        "model.toy.max_train_seconds": 900.0,  # the step rule decides, not the machine's load (~2 min when idle)
    },
}
"""What a built-in task (data.task, with no data.train_path) sets in the fields a config leaves out, so that
`data.task=think_arith` alone is a consistent run; a value in the file or on the command line always wins."""


def _fill_task_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` (a RunConfig's input) with its task's TASK_DEFAULTS added where it has no value (a copy; a
    section given as an instance is replaced by a new one with the value where that field was not given)."""
    data = raw.get("data", {})
    data = _given(data) if isinstance(data, BaseModel) else data
    if not isinstance(data, dict) or data.get("train_path") is not None:
        return raw
    task = data.get("task", DataConfig.model_fields["task"].default)
    for key, value in TASK_DEFAULTS.get(task, {}).items() if isinstance(task, str) else ():
        raw = _with_default(raw, key.split("."), value)
    return raw


def _with_default(node: Any, path: list[str], value: Any) -> Any:
    """`node` (a dict or a section) with `value` at `path` unless one is given there; `node` itself unchanged."""
    given = _given(node) if isinstance(node, BaseModel) else node
    if not isinstance(given, dict):
        return node  # not a section: validation reports it
    if len(path) == 1:
        if path[0] in given:
            return node
        update = {path[0]: value}
    else:
        child = given.get(path[0], {})
        new_child = _with_default(child, path[1:], value)
        if new_child is child:
            return node
        update = {path[0]: new_child}
    return type(node).model_validate({**given, **update}) if isinstance(node, BaseModel) else {**node, **update}


def _given(section: BaseModel) -> dict[str, Any]:
    """The fields a section instance was given, as input (the others are its defaults)."""
    return {k: getattr(section, k) for k in section.model_fields_set}
