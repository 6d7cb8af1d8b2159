"""docs/cluster.md stays true: its run config loads, every `exgrpo train` command line in it parses,
every `section.option` its prose names exists, and the weight-sync backend it recommends builds both ends."""

from __future__ import annotations

import re
import shutil
import subprocess
import shlex
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from common.config import RunConfig, load_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "cluster.md"
SECTIONS = set(RunConfig.model_fields)


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def run_configs() -> list[dict]:
    """The YAML blocks that are run configs (top-level keys are config sections; not the RayJob manifest)."""
    blocks = [yaml.safe_load(b) for b in code_blocks("yaml")]
    return [b for b in blocks if isinstance(b, dict) and set(b) <= SECTIONS]


def option_exists(path: str) -> bool:
    """Whether a dotted option names a field (any member of a union section counts)."""
    models: list[type[BaseModel]] = [RunConfig]
    for part in path.split("."):
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            return False
        models = [t for f in fields for t in (typing.get_args(f.annotation) or (f.annotation,))
                  if isinstance(t, type) and issubclass(t, BaseModel)]
        models += [t for f in fields for a in typing.get_args(f.annotation) for t in typing.get_args(a)
                   if isinstance(t, type) and issubclass(t, BaseModel)]  # Annotated[A | B, ...]
    return True


def test_run_config_block_loads_and_builds_both_weight_sync_ends(ray_cluster, tmp_path):
    from learner.weights import CollectivePublisher, CollectiveWeightSource, make_publisher, make_weight_source

    configs = run_configs()
    for i, fragment in enumerate(configs):  # every run config shown loads (the node-group example is a fragment)
        (tmp_path / f"block{i}.yaml").write_text(yaml.safe_dump(fragment))
        load_config(tmp_path / f"block{i}.yaml")
    full = [c for c in configs if "model" in c]
    assert len(full) == 1  # the 1.5B config
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(full[0]))
    cfg = load_config(path)  # paths to the model/data are checked when training starts, not here
    assert cfg.model.dtype == "bfloat16" and cfg.generator.engine.kind == "vllm"
    ws = cfg.learner.weight_sync
    assert ws.kind == "collective" and ws.backend == "nccl"
    # the recommended backend is wired at both ends (gloo here: the NCCL transport needs GPUs)
    gloo = ws.model_copy(update={"backend": "gloo"})
    assert isinstance(make_weight_source(gloo, run="doc", namespace="exgrpo-test"), CollectiveWeightSource)
    pub = make_publisher(gloo, run="doc", namespace="exgrpo-test", timeout_s=5)
    try:
        assert isinstance(pub, CollectivePublisher)
    finally:
        pub.close()


def test_train_command_lines_parse():
    lines = [ln for b in code_blocks("bash") for ln in b.replace("\\\n", " ").splitlines() if " train" in ln]
    assert lines
    for ln in lines:
        args = shlex.split(ln.split(" train", 1)[1])
        overrides = [a for a in args if "=" in a and not a.startswith("-")]
        yaml_path = next((a for a in args if a.endswith(".yaml")), None)
        if yaml_path is None:  # a command that only uses overrides must load as written
            load_config(None, overrides)
        else:  # the YAML is the run config above
            for o in overrides:
                assert option_exists(o.split("=", 1)[0]), f"{ln}: {o} names no option"


def test_every_option_named_in_prose_exists():
    named = re.findall(r"`((?:%s)\.[a-z_][a-z0-9_.]*)" % "|".join(sorted(SECTIONS)), DOC.read_text())
    assert len(named) > 10
    missing = sorted({n for n in named if not option_exists(n)})
    assert not missing, f"docs/cluster.md names options that do not exist: {missing}"


@pytest.mark.parametrize("old", ["{kind: nccl}", "{kind: nccl, master_port: 29600}"])
def test_old_nccl_kind_is_refused_with_the_replacement(old):
    from common.config import ConfigError

    with pytest.raises(ConfigError, match=r"use \{kind: collective, backend: nccl\}"):
        load_config(None, [f"learner.weight_sync={old}"])


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine runs the real check")
def test_gpu_check_validates_its_gpu_settings_here_and_says_it_skipped():
    """`make gpu-check` on a machine without a GPU: the exact settings of the GPU run (bfloat16, vLLM, NCCL)
    go through `exgrpo config`, and the script says it ran nothing; a bad setting fails it here, not on the GPU."""
    script = DOC.parents[1] / "scripts" / "gpu_check.sh"
    ok = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "config OK" in ok.stderr and "SKIPPED" in ok.stderr, ok.stderr
    bad = subprocess.run(["bash", str(script), "0"], capture_output=True, text=True, timeout=120)  # total_steps=0
    assert bad.returncode != 0 and "total_steps" in bad.stdout + bad.stderr, bad.stderr
