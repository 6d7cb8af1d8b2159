"""`exgrpo extend-context SRC DST --max-positions N [--rope-theta T]`: a copy of a model folder whose config.json
allows longer sequences, made as the LUFFY/ExGRPO authors' recipe makes it for Qwen2.5-Math (config.json's
`max_position_embeddings` 4096 -> 16384 and `rope_theta` 10000 -> 40000; their 7B run loads such a copy, a
"Qwen2.5-Math-7B-16k-think" folder).

Only config.json changes; every other file is linked (a symlink to the source's absolute path, so the copy costs
no disk and holds the same weights; `--copy` copies them, for a destination that must stand alone). RoPE with a
larger base spreads the positions the model was trained on over the longer window: what the model makes of the
positions beyond its original limit is learned in the RL run, as in the recipe, not given by this edit.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path


def extend_context(src: Path, dst: Path, max_positions: int, rope_theta: float | None = None,
                   copy: bool = False) -> dict[str, tuple]:
    """Write DST: SRC's files linked (or copied) and its config.json with the new `max_position_embeddings` and
    `rope_theta` (top level, and inside `rope_parameters` where transformers 5 keeps it). Returns
    {key: (old, new)}. ValueError with what to change when SRC is not a model folder or DST exists."""
    from cluster.preflight import model_folder_problem

    problem = model_folder_problem(src, field="SRC")
    if problem is not None:
        raise ValueError(problem)
    if dst.exists() or dst.is_symlink():
        raise ValueError(f"DST: {dst} exists; name a new folder (nothing is overwritten)")
    config = json.loads((src / "config.json").read_text())
    now = config.get("max_position_embeddings")
    if isinstance(now, int) and max_positions <= now:
        raise ValueError(f"--max-positions {max_positions} is not above the model's {now} positions: extend-context "
                         f"lengthens the window (a shorter one would cut what the model was trained on); give more "
                         f"than {now}, or use the model folder as it is")
    changes = {"max_position_embeddings": (now, max_positions)}
    config["max_position_embeddings"] = max_positions
    if rope_theta is not None:
        changes["rope_theta"] = (config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta")),
                                 rope_theta)
        config["rope_theta"] = rope_theta
        if isinstance(config.get("rope_parameters"), dict):
            config["rope_parameters"]["rope_theta"] = rope_theta
    dst.mkdir(parents=True)
    try:
        for entry in sorted(src.iterdir()):
            if entry.name == "config.json" or entry.name.startswith("."):  # .cache/ of `hf download`
                continue
            target = dst / entry.name
            if not copy:
                os.symlink(entry.resolve(), target)
            elif entry.is_dir():
                shutil.copytree(entry, target)
            else:
                shutil.copy2(entry, target)
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)  # no half-made folder left behind
        raise
    return changes


def extend_context_main(args) -> int:
    """The `exgrpo extend-context` command: exit code 0, or 2 with one line saying what to change."""
    src, dst = Path(args.src).expanduser(), Path(args.dst).expanduser()
    try:
        changes = extend_context(src, dst, args.max_positions, args.rope_theta, copy=args.copy)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = ", ".join(f"{k} {_number(old)} -> {_number(new)}" for k, (old, new) in changes.items())
    how = "copied" if args.copy else f"linked to {src.resolve()}"
    print(f"wrote {dst}: config.json {what}; the other files {how}\n"
          f"use it with model.path={dst}")
    return 0


def _number(x):
    """10000.0 as 10000 (config.json files write either)."""
    return int(x) if isinstance(x, float) and x.is_integer() else x
