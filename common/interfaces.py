"""The few interfaces that connect components. Each docstring shows the loop that uses it.

Implementations live in their packages (`buffer.client.BufferClient`, `learner.weights.*`,
`actors.engines.*`); these Protocols are what the other side may rely on. They hold for the
single-process objects and for their Ray-actor-backed clients alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

import numpy as np

from common.messages import ScoredGroup, WeightsAnnouncement, WorkItem

if TYPE_CHECKING:  # annotations only: the buffer's and the reward workers' processes never import torch for them
    import torch


class WorkSource(Protocol):
    """Where generators get work and send results (the buffer client).

        while running:
            items = source.lease(generator_id, n)      # [] when back-pressure says wait
            groups = [generate_and_score(it) for it in items]
            source.submit(groups)                      # one call for the whole batch
        source.return_leases([it.lease_id for it in unfinished])   # clean stop
    """

    def lease(self, generator_id: str, max_items: int, wait_s: float = 0.0) -> list[WorkItem]: ...

    def submit(self, groups: list[ScoredGroup]) -> dict[str, int]: ...

    def return_leases(self, lease_ids: list[str]) -> None: ...

    def end_leases_of(self, generator_id: str) -> int: ...  # its process died: its work never comes back


class WeightSource(Protocol):
    """Where generators find the newest policy (the weight-sync backend's receiving side).

        source.register(generator_id)                  # at start: publications wait for its ack
        ann = source.latest()                          # or source.wait_newer(known, wait_s): one long-poll call
        if ann is not None and ann.version > engine.version:
            engine.load_weights(source.fetch_buckets(ann), ann.version)   # or source.fetch(ann): one dict
            source.ack(generator_id, ann.version)
        source.unregister(generator_id)                # at stop
    """

    def latest(self) -> WeightsAnnouncement | None: ...

    def wait_newer(self, known: int, timeout_s: float) -> WeightsAnnouncement | None: ...  # newest once != known

    def register(self, generator_id: str) -> None: ...  # LookupError: no learner yet (the first ack registers)

    def unregister(self, generator_id: str) -> None: ...

    def transfer_stats(self) -> dict[str, int]: ...  # its own counters (delta loads, relay transfers); {}: none

    def fetch(self, ann: WeightsAnnouncement) -> dict[str, torch.Tensor]: ...

    def fetch_buckets(self, ann: WeightsAnnouncement) -> Iterator[dict[str, torch.Tensor]]: ...

    def ack(self, generator_id: str, version: int) -> None: ...


class Engine(Protocol):
    """An inference engine inside a generator actor.

    Batch use (evaluation, benchmarks):
        outs = engine.generate(prompt_ids_list, n_per_prompt, seed)   # list (per prompt) of lists

    Streaming use (the generator loop; one sample per request, any number in flight):
        engine.add(request_id, prompt_ids, seed)
        for request_id, sample in engine.step(): ...   # the samples that finished in this step
        engine.load_weights(state_dict, version)       # between steps, also with samples in flight; a dict
                                                       # or an iterable of dicts (buckets, loaded as they come)
        engine.abort(request_ids); engine.in_flight()
    """

    version: int
    slots: int  # samples decoded at once (vLLM's max_num_seqs); more than that wait in the engine's queue

    def generate(self, prompts: list[np.ndarray], n: list[int], seed: int) -> list[list["Sample"]]: ...

    def add(self, request_id: str, prompt_ids: np.ndarray, seed: int) -> None: ...

    def step(self) -> list[tuple[str, "Sample"]]: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def in_flight(self) -> int: ...

    def load_weights(self, weights: dict[str, torch.Tensor] | Iterable[dict[str, torch.Tensor]], version: int,
                     partial: bool = False) -> None: ...  # partial: only some parameters come (actors.adapters)


class Sample(Protocol):
    """One engine output before scoring."""

    token_ids: np.ndarray  # [T] int32
    logprobs: np.ndarray  # [T] float32
    entropy: float
    finish_reason: str
    text: str
    segments: tuple[tuple[int, int], ...]  # (version, first token index under it), oldest first

    @property
    def versions(self) -> tuple[int, int]: ...  # (oldest, newest)


def actor_name(run: str, role: str, index: int | None = None) -> str:
    """Name of a run's Ray actor in the run's namespace, e.g. `myrun/buffer-0`, `myrun/weights`."""
    return f"{run}/{role}" if index is None else f"{run}/{role}-{index}"


def near_caller() -> dict:
    """Actor options that place a run's stateful singletons (buffer shards, weight store, control) on the node
    of the process that creates them (the driver): a worker node that is lost or scaled away then takes only
    generators or learner ranks with it, which the run replaces. The affinity is hard: Ray 2.60 treats a soft
    one as a mere hint and placed these 0-CPU actors on either node of a two-node cluster; and when the
    driver's node is lost, the run is lost with it anyway."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
