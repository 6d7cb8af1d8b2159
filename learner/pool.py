"""The learner pool: N training ranks as Ray actors, joined by torch.distributed, model sharded with FSDP2.

    pool = LearnerPool(cfg.learner, model_path, shape, run=run, namespace=ns)   # shape: learner.shape.TrainShape
    pending = pool.publish_async()                  # version 0 for late-joining generators
    while training:
        batch = buffer.get_batch(pool.version, timeout_s)   # overlaps with the gather + put of `pending`
        result = pool.step(batch)                   # queued behind the publication on every rank
        buffer.feedback(result.feedback); buffer.set_version(result.version); pending = pool.publish_async()
    pending.result()                                # WeightSyncTimeout if it stalled

Why the order is safe, and precision (FSDP2 mixed precision, float32 masters): docs/internals.md#learnerpoolpy
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import ray
import torch

from common import codec
from common.config import LearnerConfig
from common.interfaces import actor_name
from common.messages import LearnerFeedback, PublishReport, TrainingBatch, WeightsAnnouncement, float32_array
from learner import checkpoint as ck
from learner.gather import Staging
from learner.schedule import learning_rate
from learner.shape import TrainShape
from learner.step import RankStats, merge_rank_stats
from learner.weights import WeightSyncTimeout, get_or_create_store, make_publisher, wait_for_acks

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(slots=True)
class StepResult:
    """What one learner step produced.  # learner -> driver"""

    metrics: dict[str, float]
    feedback: LearnerFeedback
    version: int  # policy version after the step


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far on `device`: CUDA's max allocated bytes (what the step's tensors needed,
    the caching allocator's slack left out), or on the CPU the peak resident set (VmHWM: model, optimizer and the
    step's tensors alike)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0


class LearnerRank:
    """One FSDP rank (run as a Ray actor by `LearnerPool`; usable in-process for world size 1)."""

    def __init__(self, cfg: LearnerConfig, model_path: str, shape: TrainShape, *, rank: int, run: str,
                 namespace: str | None):
        """Rank `rank` of `shape.world`; `shape`: the run's lengths and dtypes (`learner.shape`)."""
        torch.set_num_threads(max(1, int(cfg.num_cpus)))  # one intra-op thread per reserved CPU (1 by default)
        self.cfg, self.model_path, self.shape, self.rank, self.world = cfg, model_path, shape, rank, shape.world
        self.dtype = shape.torch_dtype  # compute dtype; master weights stay float32
        self.publish_dtype = shape.torch_publish_dtype  # what publications carry (the engines' dtype)
        self.run, self.namespace = run, namespace
        use_nccl = cfg.backend == "nccl" or (cfg.backend == "auto" and cfg.num_gpus > 0 and torch.cuda.is_available())
        if use_nccl and not torch.cuda.is_available():
            raise RuntimeError("learner.backend=nccl but this rank sees no GPU: "
                               "set learner.num_gpus > 0 or learner.backend=gloo")
        self.backend = "nccl" if use_nccl else "gloo"
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_nccl else torch.device("cpu")
        self.publisher = None
        self.staging = None  # learner.gather.Staging: the gather's reused buffers (made with the model)

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's host and the port of its rendezvous store for torch.distributed: a TCPStore that rank 0 holds from
        now on, listening on the node's IP only (`learner.collective.listening_store`: no bind/close/re-bind race
        for the port). One rank needs no store on the network: port 0 says so and `setup` uses a HashStore."""
        host = ray.util.get_node_ip_address()
        if self.world == 1:
            return host, 0
        from learner.collective import listening_store

        self.rendezvous = listening_store(host, 0, RENDEZVOUS_TIMEOUT.total_seconds())
        return host, self.rendezvous.port

    def setup(self, address: tuple[str, int]) -> tuple[dict[str, str], str | None]:
        """Join the process group at rank 0's `address` (`rendezvous_address`), load and shard the model
        (`learner.setup.setup_rank`). Returns the levers that failed their trial at setup and are off, with the
        error of each (`learner.trial`; the same on every rank), and the model's line for the console (LoRA)."""
        from learner.setup import setup_rank

        host, port = address
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
        if self.world == 1:
            store = torch.distributed.HashStore()
        elif self.rank == 0:
            store = self.rendezvous
        else:
            store = torch.distributed.TCPStore(host, port, world_size=self.world, is_master=False,
                                               timeout=RENDEZVOUS_TIMEOUT)
        torch.distributed.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world,
                                             timeout=RENDEZVOUS_TIMEOUT)
        torch.manual_seed(self.cfg.seed + self.rank)
        np.random.seed(self.cfg.seed + self.rank)
        built = setup_rank(self.cfg, self.model_path, self.shape, rank=self.rank, device=self.device)
        self.model, self.optimizer, self.trainer = built.model, built.optimizer, built.trainer
        self.model_config = built.model.config
        self.staging = Staging()
        return dict(built.levers_off or {}), built.summary

    def train(self, payload: bytes) -> RankStats:
        """One step on a msgpack-encoded TrainingBatch (the driver puts it once; every rank reads it), at the
        learning rate of the schedule for the batch's version (the learner step it trains)."""
        batch = codec.decode(payload, TrainingBatch)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.cfg.optim, batch.version)
        stats = self.trainer.run(batch)
        stats.peak_memory_bytes = peak_memory_bytes(self.device)
        return stats

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Collective: every rank must call it; rank 0 gets the full CPU state dict (HF names; the fp32
        master weights, or cast to `dtype`), others {}. Bucketed: a few gathers, not one per parameter."""
        from learner.gather import gather_full_state

        return gather_full_state(self.model, self.rank, self.world, dtype=dtype)

    def publish(self, version: int) -> PublishReport | None:
        """Collective. The gather streams into the publisher bucket by bucket (`learner.gather`: flat buckets
        through reused host buffers, each valid until the next is asked for): the object store puts one object
        per bucket (rank 0 holds its shard and a bucket or two); the collective backend has each bucket gathered
        into the buffer it keeps for its channels (`bucket_buffer`), on the GPU where it sends from there. Rank 0
        returns how long it was busy (`PublishReport.blocking_s`): the learner's next step, queued behind this call,
        waits that long. With `learner.lora.publish: adapters` only the adapter tensors are gathered and published, the
        announcement saying so (`AdapterPublication`: scaling and targets); the generators merge them into their
        base."""
        from common.messages import AdapterPublication
        from learner.gather import iter_flat_buckets
        from learner.lora import lora_modules

        t0 = time.perf_counter()
        lora = self.cfg.lora
        adapters = None
        if lora is not None and lora.publish == "adapters":
            adapters = AdapterPublication(scaling=lora.alpha / lora.rank, targets=list(lora_modules(self.model)))
        if self.rank == 0 and self.publisher is None:
            self.publisher = make_publisher(self.cfg.weight_sync, run=self.run, namespace=self.namespace,
                                            timeout_s=self.cfg.publish_timeout_s)
            if adapters is not None:
                log.info("learner.lora.publish=adapters: publications carry only the adapters of %d Linear modules "
                         "(A and B, rank %d); each generator merges W + %g B A into its base", len(adapters.targets),
                         lora.rank, adapters.scaling)
        publisher = self.publisher if self.rank == 0 else None  # rank 0 publishes; the others gather with it
        on_device = publisher is not None and publisher.takes_device_buckets
        keeper = publisher.bucket_buffer if publisher is not None else None  # keeps every bucket (collective)
        buckets = iter_flat_buckets(self.model, self.rank, self.world, dtype=self.publish_dtype,
                                    bucket_bytes=int(self.cfg.weight_sync.bucket_mb * (1 << 20)),
                                    staging=self.staging, to_host=not on_device, alloc=keeper,
                                    adapters=adapters is not None)
        if self.rank != 0:
            for _ in buckets:  # the gathers are collectives: every rank runs them
                pass
            return None
        waited = [0.0]

        def timed():
            while True:
                t = time.perf_counter()
                bucket = next(buckets, None)
                waited[0] += time.perf_counter() - t
                if bucket is None:
                    return
                yield bucket

        ann = self.publisher.publish(version, timed(), adapters=adapters)
        return PublishReport(ann, blocking_s=time.perf_counter() - t0, gather_s=waited[0])

    def weight_sync_status(self) -> dict:
        """The publisher's view (collective: channels served, failed channels with generator ids); {} elsewhere."""
        return self.publisher.status() if self.publisher is not None else {}

    def gather(self) -> dict[str, torch.Tensor] | None:
        sd = self.full_state_dict()
        return sd if self.rank == 0 else None

    def export_model(self, out: Path) -> None:
        """Collective: the Hugging Face model folder `out` in the compute dtype, written by rank 0. It streams:
        gathered a bucket (`weight_sync.bucket_mb`) at a time, already cast, each bucket written at its offset in
        model.safetensors, so rank 0 never holds the whole model beside its shard."""
        from learner.gather import iter_flat_buckets, published_specs, tied_aliases

        chunks = iter_flat_buckets(self.model, self.rank, self.world, dtype=self.dtype, staging=self.staging,
                                   bucket_bytes=int(self.cfg.weight_sync.bucket_mb * (1 << 20)))
        if self.rank == 0:  # a tied head is gathered once and written under both names (the folder stays as it was)
            ck.write_hf_folder(chunks, ck.tensor_specs(published_specs(self.model), self.dtype), self.model_config,
                               self.model_path, Path(out), dtype=self.dtype, aliases=tied_aliases(self.model))
        else:
            for _ in chunks:  # the gathers are collectives: every rank runs them
                pass

    def export_adapter(self, out: Path) -> None:
        """Collective, with `learner.lora`: the adapters alone as a peft adapter folder `out` (adapter_config.json,
        adapter_model.safetensors under peft's names, float32 as trained), written by rank 0 from the same bucketed
        gather as an adapter-only publication; `base_model_name_or_path` is this run's model folder."""
        from learner.gather import iter_flat_buckets
        from learner.lora import adapter_names

        lora = self.cfg.lora
        chunks = iter_flat_buckets(self.model, self.rank, self.world, staging=self.staging, adapters=True,
                                   bucket_bytes=int(self.cfg.weight_sync.bucket_mb * (1 << 20)))
        if self.rank == 0:
            names = adapter_names(self.model)
            specs = ck.tensor_specs({k: v for k, v in self.model.state_dict().items() if k in names}, torch.float32)
            config = ck.peft_adapter_config(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                            target_modules=lora.target_modules, base_model=self.model_path)
            ck.write_peft_adapter(chunks, specs, config, Path(out))
        else:
            for _ in chunks:  # the gathers are collectives: every rank runs them
                pass

    def save(self, tmp: str) -> None:
        """The model folder in the compute dtype (with LoRA: merged, and the peft adapter folder beside it); AdamW
        state and, below float32 or with LoRA, the float32 master weights in the DCP folder (see
        `learner.checkpoint`; with LoRA the model folder holds merged weights, so the base and its adapters are
        restored from the DCP folder)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from common.disk import plain_disk_errors

        tmp_path = Path(tmp)
        with plain_disk_errors(tmp_path):  # ENOSPC & co. reach the driver as such, not as DCP's or torch's wrappers
            self.export_model(tmp_path / ck.MODEL_DIR)
            if self.cfg.lora is not None:
                self.export_adapter(tmp_path / ck.ADAPTER_DIR)
            state = {"optim": get_optimizer_state_dict(self.model, self.optimizer)}
            if self.dtype != torch.float32 or self.cfg.lora is not None:
                state[ck.MASTER_KEY] = get_model_state_dict(self.model)  # float32 shards, each rank its own
            dcp.save(state, checkpoint_id=str(tmp_path / ck.OPTIM_DIR))
            ck.save_rng(tmp_path, self.rank)

    def load(self, ckpt: str) -> None:
        """Restore model, optimizer and RNG from `ckpt`, running no code from it: every entry of the DCP folder is
        checked first (`ck.check_dcp_folder`, on every rank alike, so all refuse together before any collective),
        then read by `ck.load_dcp`. CheckpointError naming the file for a corrupt or planted one."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_model_state_dict,
                                                             set_optimizer_state_dict)

        folder = Path(ckpt) / ck.OPTIM_DIR
        meta = ck.check_dcp_folder(folder)
        master = any(k.startswith(ck.MASTER_KEY + ".") for k in meta.state_dict_metadata)  # saved below float32
        if not master:
            full = ck.load_hf_weights(ckpt)
            try:
                set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True))
            except RuntimeError as e:
                raise ck.CheckpointError(
                    f"checkpoint {ckpt}: weights do not fit the model of {self.model_path} ({e})") from e
        state = {"optim": get_optimizer_state_dict(self.model, self.optimizer)}
        if master:
            state[ck.MASTER_KEY] = get_model_state_dict(self.model)
        try:
            ck.load_dcp(state, folder)
        except ck.CheckpointError:
            raise
        except (RuntimeError, ValueError, OSError) as e:
            raise ck.CheckpointError(f"checkpoint {ckpt}: optimizer state / master weights are unreadable ({e})") from e
        if master:
            set_model_state_dict(self.model, state[ck.MASTER_KEY])
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        if not ck.load_rng(Path(ckpt), self.rank):
            log.warning("checkpoint %s has no RNG state for rank %d (saved with another world size)", ckpt, self.rank)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class PendingPublish:
    """A publication in flight; `result()` waits for it (with the configured timeout) and returns the announcement;
    `report` is rank 0's `PublishReport` once it is done."""

    def __init__(self, version: int, refs: list, timeout_s: float):
        self.version, self.refs, self.timeout_s = version, refs, timeout_s
        self.report: PublishReport | None = None

    def result(self, timeout_s: float | None = None) -> WeightsAnnouncement:
        if self.report is None:
            t = self.timeout_s if timeout_s is None else timeout_s
            try:
                self.report = ray.get(self.refs, timeout=t)[0]
            except ray.exceptions.GetTimeoutError as e:
                raise WeightSyncTimeout(f"publishing weights version {self.version} did not finish within {t:.1f}s "
                                        "(gather on the learner ranks + put into the weight store)") from e
        return self.report.announcement


def _learner_placement_group(cfg: LearnerConfig):
    """One bundle per rank (its CPUs/GPUs), placed by `cfg.placement`; None for `none` (or nothing to reserve).

    `pack` keeps the ranks of one job together (fast collectives); `spread` puts them on different
    nodes. Returned at once: `_wait_placed` bounds the wait for the resources."""
    if cfg.placement == "none":
        return None
    from ray.util.placement_group import placement_group

    bundle = _rank_bundle(cfg)
    if not bundle:
        return None
    labels = [dict(cfg.node_labels) for _ in range(cfg.num_ranks)] if cfg.node_labels else None
    return placement_group([dict(bundle) for _ in range(cfg.num_ranks)], strategy=cfg.placement.upper(),
                           bundle_label_selector=labels)


def _rank_bundle(cfg: LearnerConfig) -> dict[str, float]:
    bundle = {"CPU": float(cfg.num_cpus)} if cfg.num_cpus else {}
    if cfg.num_gpus:
        bundle["GPU"] = float(cfg.num_gpus)
    return bundle


def _wait_placed(pg, cfg: LearnerConfig) -> None:
    """Wait up to `publish_timeout_s` for the placement group; say which resources are missing otherwise."""
    ready, _ = ray.wait([pg.ready()], timeout=cfg.publish_timeout_s)
    if not ready:
        where = (" on nodes labelled " + ", ".join(f"{k}={v}" for k, v in cfg.node_labels.items())
                 if cfg.node_labels else "")
        raise RuntimeError(
            f"learner placement group of {cfg.num_ranks} x {_rank_bundle(cfg)}{where} ({cfg.placement}) could not be "
            f"placed within {cfg.publish_timeout_s:.0f}s; the cluster has {ray.available_resources()} free. Lower "
            "learner.num_ranks / num_cpus / num_gpus, add nodes" + (", or check learner.node_labels" if where else ""))


def _bundle(pg, index: int):
    if pg is None:
        return None
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


class LearnerPool:
    """N `LearnerRank` actors training one policy; see the module docstring for the loop."""

    def __init__(self, cfg: LearnerConfig, model_path: str, shape: TrainShape, *, run: str, namespace: str | None,
                 wait: bool = True):
        """`shape`: the run's lengths and dtypes (`learner.shape.TrainShape`: the compute dtype of the ranks, see
        the module docstring, what publications carry, the longest prompt and response, a batch's rows); the pool
        sets its `world` to `cfg.num_ranks`. `wait=False` returns as soon as the ranks are asked for (their
        processes start, load and shard the model in the background: the driver builds the rest meanwhile); call
        `wait_ready()` before use."""
        self.cfg, self.model_path, self.run, self.namespace = cfg, str(model_path), run, namespace
        shape = replace(shape, world=cfg.num_ranks)
        self.version = 0
        self.steps = 0
        self.skipped_updates = 0
        self.levers_off: dict[str, str] = {}  # levers that failed their trial at setup -> error (after wait_ready)
        self.summary: str | None = None  # rank 0's line for the console (LoRA's adapters), after wait_ready
        self.store = get_or_create_store(run, namespace)
        reset = self.store.reset.remote()  # a resumed pool may publish a lower version than a dead one did
        actor = ray.remote(LearnerRank)
        self.placement_group = _learner_placement_group(cfg)
        self.ranks = [
            actor.options(name=actor_name(run, "learner", r), namespace=namespace, num_cpus=cfg.num_cpus,
                          num_gpus=cfg.num_gpus, max_restarts=0, scheduling_strategy=_bundle(self.placement_group, r),
                          **({"label_selector": dict(cfg.node_labels)}
                             if cfg.node_labels and self.placement_group is None else {})).remote(
                cfg, self.model_path, shape, rank=r, run=run, namespace=namespace)
            for r in range(cfg.num_ranks)
        ]
        address = self.ranks[0].rendezvous_address.remote()  # resolved by Ray before each rank's setup runs
        self._setup = [reset] + [r.setup.remote(address) for r in self.ranks]
        self._last_publish: PendingPublish | None = None
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.shutdown()
                raise

    def wait_ready(self) -> None:
        """Wait (bounded) until every rank has joined the process group and sharded the model: first the
        placement group (`publish_timeout_s`, naming the missing resources), then the setup
        (`start_timeout_s`, naming the ranks not ready). A rank's own error is raised as is."""
        if self._setup is None:
            return
        if self.placement_group is not None:
            _wait_placed(self.placement_group, self.cfg)
        deadline = time.monotonic() + self.cfg.start_timeout_s
        pending = list(self._setup)
        while pending:  # one at a time: a rank's error is raised at once, not after the others time out
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = [i - 1 for i, ref in enumerate(self._setup) if ref in pending and i > 0]
                raise RuntimeError(
                    f"learner rank(s) {late} were not set up within learner.start_timeout_s="
                    f"{self.cfg.start_timeout_s:.0f}s (model load, FSDP sharding, torch.distributed rendezvous); "
                    "see the ranks' logs in the run folder's logs/ray, or raise learner.start_timeout_s for a large "
                    "model")
            value = ray.get(ready[0])
            if ready[0] == self._setup[1]:  # rank 0's setup: the levers the ranks agreed to switch off
                self.levers_off, self.summary = dict(value[0]), value[1]
        self._setup = None

    def step(self, batch: TrainingBatch) -> StepResult:
        """Train on `batch` (`learner.batching.mini_batches` optimizer updates, each applied or skipped).

        The policy version advances by exactly 1 per step (see `common.messages`), also when every
        update was skipped: the buffer's back-pressure and staleness count steps, and a step that
        changed no weight must still end the step for them (else a synchronous run would stall)."""
        ref = ray.put(codec.encode(batch))  # msgpack, not pickle: the message type is the contract
        stats: list[RankStats] = ray.get([r.train.remote(ref) for r in self.ranks])
        metrics, sfb = merge_rank_stats(stats)
        version_trained = self.version
        self.version += 1
        self.skipped_updates += stats[0].skipped
        self.steps += 1
        metrics["learner/version"] = float(self.version)
        metrics["learner/lr"] = learning_rate(self.cfg.optim, version_trained)
        metrics["learner/skipped_updates_total"] = float(self.skipped_updates)
        metrics["learner/levers_off"] = float(len(self.levers_off))  # failed their trial at setup (learner.trial)
        fb = LearnerFeedback(version=version_trained, keys=sfb.keys, entropies=float32_array(sfb.entropies),
                             chosen=sfb.chosen, fresh_keys=sfb.fresh_keys,
                             fresh_entropies=float32_array(sfb.fresh_entropies), fresh_logprobs=sfb.fresh_logprobs)
        return StepResult(metrics=metrics, feedback=fb, version=self.version)

    def publish_async(self) -> PendingPublish:
        """Start publishing the current version; returns at once. Republishing a version is a no-op."""
        last = self._last_publish
        if last is not None and last.version == self.version:
            return last
        refs = [r.publish.remote(self.version) for r in self.ranks]
        self._last_publish = PendingPublish(self.version, refs, self.cfg.publish_timeout_s)
        return self._last_publish

    def publish(self) -> WeightsAnnouncement:
        """Gather on rank 0 and publish the current version; WeightSyncTimeout after `publish_timeout_s`."""
        return self.publish_async().result()

    def wait_for_acks(self, version: int | None = None, timeout_s: float | None = None) -> None:
        """Block until every registered generator acknowledged `version` (default: current); else WeightSyncTimeout."""
        wait_for_acks(self.store, self.version if version is None else version,
                      self.cfg.publish_timeout_s if timeout_s is None else timeout_s)

    def weight_sync_status(self) -> dict:
        """Rank 0's publisher status (collective: {"channels", "failures", "served", ...}); {} for the object store."""
        return ray.get(self.ranks[0].weight_sync_status.remote(), timeout=self.cfg.publish_timeout_s)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict (HF names, CPU) on the caller."""
        return ray.get([r.gather.remote() for r in self.ranks])[0]

    def save_checkpoint(self, dir: str | Path) -> Path:
        """Write a checkpoint folder atomically (see `learner.checkpoint`); returns its path."""
        tmp = ck.tmp_dir_for(dir)
        try:
            ray.get([r.save.remote(str(tmp)) for r in self.ranks])
            ck.write_meta(tmp, step=self.steps, version=self.version, num_ranks=len(self.ranks))
            return ck.commit(tmp, dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def load_checkpoint(self, dir: str | Path) -> None:
        """Restore model, optimizer, RNG, step and version; CheckpointError for a missing/corrupt checkpoint."""
        meta = ck.read_meta(dir)
        ray.get([r.load.remote(str(Path(dir).absolute())) for r in self.ranks])
        self.steps, self.version = int(meta["step"]), int(meta["version"])
        self._last_publish = None

    def shutdown(self) -> None:
        """Stop the ranks and the weight store (published references die with rank 0). Ranks still
        setting up are killed at once (a close would queue behind their setup)."""
        try:
            if self._setup is None:
                ray.get([r.close.remote() for r in self.ranks], timeout=30)
        finally:
            for r in self.ranks:
                ray.kill(r)
            ray.kill(self.store)
            self.ranks = []
            if self.placement_group is not None:
                ray.util.remove_placement_group(self.placement_group)
                self.placement_group = None
