"""The root `RunConfig`: every section, and the rules that span sections."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from common.config.base import Section, yaml_value
from common.config.buffer import BufferConfig
from common.config.cluster import ClusterConfig
from common.config.data import DataConfig, _fill_task_defaults
from common.config.eval import EvalConfig
from common.config.generator import GeneratorConfig, SyntheticEngineConfig
from common.config.learner import CollectiveSyncConfig, LearnerConfig
from common.config.model import ModelConfig
from common.config.reward import RewardConfig
from common.config.tracking import CheckpointConfig, TrackingConfig


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
"""What a run name may be: one folder name (no `/`, not `.` or `..`), also usable in Ray actor names."""


class RunConfig(Section):
    """The whole run. Each component receives only its own section."""

    name: str | None = None
    """Run name: the run's folder under `checkpoint.runs_root` and the prefix of its Ray actors' names. Letters,
    digits, `.`, `_` and `-`, starting with a letter or digit, at most 100 characters (default: run-<date>-<time>)."""
    total_steps: int = Field(60, ge=1, le=10_000_000)
    """Learner batches to train."""
    total_rollouts: int | None = Field(None, ge=1)
    """Also stop once the learner has trained this many generated rollouts (fresh ones: K per fresh group,
    K-1 per mixed group): the equal-budget stop `exgrpo experiment` uses. None: total_steps only."""
    seed: int = Field(0, ge=0, le=2**32 - 1)  # numpy and vLLM take 32-bit seeds
    """Global seed (sections have their own seeds for finer control)."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    generator: GeneratorConfig = GeneratorConfig()
    buffer: BufferConfig = BufferConfig()
    learner: LearnerConfig = LearnerConfig()
    cluster: ClusterConfig = ClusterConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()

    @field_validator("name", mode="before")
    @classmethod
    def _one_folder_name(cls, v: Any) -> Any:
        """A single safe path component: `../x` or `/tmp/x` would put the run outside checkpoint.runs_root."""
        if isinstance(v, int) and not isinstance(v, bool):
            v = str(v)  # name=7 on the command line is read as a number
        if isinstance(v, str) and len(v) > 100:
            raise ValueError(f"{len(v)} characters; a run name is at most 100 (it names the run's folder and its "
                             "Ray actors)")
        if isinstance(v, str) and not RUN_NAME.fullmatch(v):
            raise ValueError(f"{v!r} is not a run name: use one folder name of letters, digits, '.', '_' and '-' "
                             "starting with a letter or digit (e.g. name=my-run-1); the run's folder is always "
                             "created under checkpoint.runs_root")
        return v

    @model_validator(mode="before")
    @classmethod
    def _task_defaults(cls, raw: Any) -> Any:
        """TASK_DEFAULTS fill what the input leaves out, before validation, so that section checks (the toy
        model's head size, ...) see the values the run will use."""
        return _fill_task_defaults(raw) if isinstance(raw, dict) else raw

    @model_validator(mode="after")
    def _lr_schedule(self) -> RunConfig:
        """The schedule's horizon and warmup in steps, resolved once so the saved config carries them."""
        opt = self.learner.optim
        update: dict[str, Any] = {}
        horizon = opt.lr_decay_steps or self.total_steps
        if opt.warmup_steps > horizon:
            raise ValueError(f"learner.optim.warmup_steps: {opt.warmup_steps} warmup steps outlast the schedule's "
                             f"{horizon} steps "
                             f"({'learner.optim.lr_decay_steps' if opt.lr_decay_steps else 'total_steps'}): the "
                             "learning rate would never reach learner.optim.lr; set learner.optim.warmup_steps at most "
                             f"{horizon} (or learner.optim.warmup_ratio), or raise total_steps")
        if opt.lr_decay_steps is None and (opt.lr_schedule != "constant" or opt.warmup_ratio is not None):
            update["lr_decay_steps"] = horizon
        if opt.warmup_ratio is not None:
            update.update(warmup_steps=round(opt.warmup_ratio * horizon), warmup_ratio=None)
        if update:
            self.learner = self.learner.model_copy(update={"optim": opt.model_copy(update=update)})
        return self

    @model_validator(mode="after")
    def _generator_dtype(self) -> RunConfig:
        """generator.dtype None means model.dtype: resolved here so the generators' section carries it."""
        if self.generator.dtype is None:
            self.generator = self.generator.model_copy(update={"dtype": self.model.dtype})
        return self

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        problems = []
        a = self.cluster.autoscale
        if a.min_generators > a.max_generators:
            problems.append(
                f"cluster.autoscale.min_generators: {a.min_generators} exceeds max_generators {a.max_generators}"
            )
        if self.generator.num_generators == 0 and not a.enabled:
            problems.append("generator.num_generators: 0 generators and no autoscale would never produce a batch")
        if self.buffer.batch_questions % self.learner.batching.mini_batches:
            problems.append(
                f"learner.batching.mini_batches: {self.learner.batching.mini_batches} does not divide "
                f"buffer.batch_questions {self.buffer.batch_questions}"
            )
        ahead = self.buffer.batch_questions * (self.buffer.max_lag + 1)  # the most questions ever issued at once
        if "questions_per_lease" in self.generator.model_fields_set and self.generator.questions_per_lease > ahead:
            problems.append(f"generator.questions_per_lease: {self.generator.questions_per_lease} is more than a lease "
                            f"can ever hold: the buffer issues at most buffer.batch_questions x (buffer.max_lag + 1) = "
                            f"{ahead} questions ahead of the learner, and one lease that large leaves the other "
                            f"generators idle; set it at most {ahead} (the default, 8, adapts)")
        if self.learner.loss.clip_fresh == "auto" and self.buffer.replay_ratio == 0:
            problems.append("learner.loss.clip_fresh: auto unclips fresh tokens once mixed mode starts, and "
                            "buffer.replay_ratio=0 (GRPO) replays nothing but still switches mixed mode on: its PPO "
                            "clip would go with no replay to stand in for it; set learner.loss.clip_fresh=true "
                            "(false: never clipped, if that is what you mean)")
        if self.buffer.replay_ratio > 0 and not self.buffer.collect:
            problems.append("buffer.collect: false leaves nothing to replay while buffer.replay_ratio > 0; "
                            "set buffer.replay_ratio=0 for plain GRPO")
        if self.eval.every_steps and self.data.train_path is not None and self.data.test_path is None \
                and not self.eval.sets:
            problems.append("eval.every_steps: in-run evaluation needs held-out questions; set data.test_path "
                            "or eval.every_steps=0")
        if self.eval.every_steps and isinstance(self.learner.weight_sync, CollectiveSyncConfig):
            problems.append("eval.every_steps: the in-run evaluator reads each version from Ray's object store, which "
                            "learner.weight_sync.kind=collective leaves empty (its versions go over the generators' "
                            "channels only); set learner.weight_sync.kind=object_store, or eval.every_steps=0 and "
                            "evaluate checkpoints with `exgrpo eval`")
        problems += self._data_problems()
        budget = self.learner.batching.micro_batch_tokens
        longest = self.data.max_prompt_tokens + self.generator.max_new_tokens
        if budget is not None and budget < longest:
            problems.append(f"learner.batching.micro_batch_tokens: {budget} cannot hold one row of "
                            f"data.max_prompt_tokens + generator.max_new_tokens = {longest} tokens; raise it to at "
                            f"least {longest}")
        problems += self._sizes()
        ws = self.learner.weight_sync
        if isinstance(ws, CollectiveSyncConfig) and ws.backend == "nccl" and (
                self.generator.num_gpus == 0 or self.learner.num_gpus == 0):
            problems.append("learner.weight_sync.backend: nccl needs GPUs on the learner and the generators "
                            "(learner.num_gpus > 0, generator.num_gpus > 0); use backend: auto or gloo")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _data_problems(self) -> list[str]:
        """The data, its task and the reward that scores it, and the engine that generates it."""
        problems = []
        if self.data.task is None and self.data.train_path is None:
            problems.append("data: set data.task to a built-in task or data.train_path to a file")
        elif self.data.train_path is None and self.data.test_path is not None:
            problems.append(f"data.test_path: {self.data.test_path} is a held-out split of data.train_path, which is "
                            f"not set (the built-in {self.data.task} task makes its own test split); set "
                            "data.train_path to your training file, or evaluate the file beside the task with "
                            f"eval.sets.<name>.path={self.data.test_path}")
        if self.data.train_path is None and self.data.task is not None:
            problems += _task_problems(self.data, self.reward.name, self.model.path is None)
        elif "task" in self.data.model_fields_set and self.data.task not in (None, "countdown"):
            problems.append(_task_with_a_file(self.data))  # countdown, the default: what `exgrpo config` writes
        if isinstance(self.generator.engine, SyntheticEngineConfig) or self.reward.name == "synthetic":
            problems.append("generator.engine.kind / reward.name: synthetic is a simulation for bench/cluster_sim.py; "
                            "its random tokens cannot train a model: use engine kind vllm, transformers or auto "
                            "and the task's reward")
        return problems

    def _sizes(self) -> list[str]:
        """Sizes that cannot work together: a mini-batch with fewer rows than learner ranks."""
        problems = []
        b, lc = self.buffer, self.learner
        rows = b.batch_questions * b.group_size // lc.batching.mini_batches
        if 0 < rows < lc.num_ranks:  # no row at all: more mini-batches than questions, said on its own line
            problems.append(f"learner.num_ranks: {lc.num_ranks} ranks share {rows} rows per mini-batch "
                            f"(buffer.batch_questions {b.batch_questions} x buffer.group_size {b.group_size} / "
                            f"learner.batching.mini_batches {lc.batching.mini_batches}): a rank would get none; set "
                            f"learner.num_ranks at most {rows}, or raise buffer.batch_questions")
        return problems


def _task_problems(data: DataConfig, reward_name: str, builtin_model: bool) -> list[str]:
    """A built-in reward that cannot read the task's answers; a prompt encoding its built-in model was not
    trained on."""
    from common.reward_registry import BUILTIN_NAMES
    from common.tasks import get_task

    from common.tasks import TASKS

    task, problems = get_task(data.task), []
    if reward_name in BUILTIN_NAMES and reward_name not in task.rewards:
        others = f" (or {', '.join(task.rewards[1:])})" if task.rewards[1:] else ""
        takers = [t for t, spec in TASKS.items() if reward_name in spec.rewards]
        instead = (f", or keep it with data.task={' or data.task='.join(takers)} or data.train_path=<your data file>"
                   if takers else ", or keep it with data.train_path=<your data file>")
        problems.append(f"reward.name: {reward_name} cannot score the {task.name} task; "
                        f"set reward.name={task.rewards[0]}{others}{instead}")
    if builtin_model and data.use_chat_template != task.chat:
        problems.append(
            f"data.use_chat_template: the built-in {task.name} model is a chat model (BPE tokenizer with a chat "
            "template); set data.use_chat_template=true, its default" if task.chat else
            f"data.use_chat_template: the built-in {task.name} model has a character tokenizer and no chat "
            "template; set data.use_chat_template=false, or model.path to a chat model")
    return problems


def _task_with_a_file(data: DataConfig) -> str:
    """`data.task=think_arith data.train_path=x.jsonl`: the questions come from the file, so the task would be
    printed and then ignored, its settings with it."""
    from common.config.data import TASK_DEFAULTS

    sets = [f"{k}={yaml_value(v)}" for k, v in TASK_DEFAULTS.get(data.task, {}).items()
            if not k.startswith(("model.toy.", "generator.max_new_tokens"))]
    what = f"; for your data in the {data.task} format set {' '.join(sets)}" if sets else ""
    return (f"data.task: {data.task} is not used when data.train_path is set (the questions come from "
            f"{data.train_path}, not from the task): set data.task=null{what}; or leave out data.train_path to "
            f"train on the built-in {data.task} task")
