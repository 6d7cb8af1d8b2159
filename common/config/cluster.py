"""The `cluster` section (with autoscale)."""

from __future__ import annotations

from pydantic import Field

from common.config.base import Section


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
    grow_cluster: bool = False
    """The cluster has a Ray autoscaler (KubeRay, a cloud cluster launcher): scale up even when no CPUs are free,
    so that the pending generator makes the autoscaler add a node; at most one generator waits for a node at a
    time. Nodes left idle after a scale-down are removed by the autoscaler (its idle_timeout_minutes)."""


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
