"""`exgrpo` command line. Thin: parse, load config, hand over. Heavy imports happen after parsing."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="exgrpo", description="ExGRPO: RLVR with managed experience replay on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train with ExGRPO (no arguments: the built-in task on this machine)")
    t.add_argument("config", nargs="?", help="YAML config file (optional)")
    t.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. buffer.max_lag=0")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")

    c = sub.add_parser("config", help="print the resolved config as YAML")
    c.add_argument("config", nargs="?", help="YAML config file (optional)")
    c.add_argument("overrides", nargs="*", help="dotted.key=value overrides")

    m = sub.add_parser("toy-model", help="build (or reuse) the built-in model and print its accuracy spread")
    m.add_argument("config", nargs="?", help="YAML config file (optional)")
    m.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    m.add_argument("--force", action="store_true", help="rebuild even when cached")

    e = sub.add_parser("eval", help="greedy and sampled accuracy of a model on a test split")
    e.add_argument("--model", required=True, help="Hugging Face model folder")
    e.add_argument("--task", choices=["countdown", "arithmetic"], help="built-in task (default: the config's)")
    e.add_argument("--data", help="JSONL/Parquet test file (instead of a built-in task)")
    e.add_argument("--samples", type=int, default=8, help="samples per question for pass@k")
    e.add_argument("--limit", type=int, default=None, help="evaluate at most this many questions")
    e.add_argument("config", nargs="?", help="YAML config file (optional)")
    e.add_argument("overrides", nargs="*", help="dotted.key=value overrides")

    s = sub.add_parser("scale", help="change the number of generator actors of a running job")
    s.add_argument("--generators", type=int, required=True, help="target number of generators")
    s.add_argument("--run", required=True, help="run name (as printed by `exgrpo train`)")
    s.add_argument("--address", default="auto", help="Ray address of the running job")
    s.add_argument("--namespace", default="exgrpo", help="Ray namespace of the run")
    s.add_argument("--runs-root", default="runs", help="parent of run folders (to find the run's Ray address)")
    return p


def _split_config_args(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """argparse cannot tell `train a=b` (no file) from `train file.yaml`; a token with `=` is an override."""
    items = ([args.config] if args.config else []) + list(args.overrides)
    path = None
    if items and "=" not in items[0]:
        path, items = items[0], items[1:]
    return path, items


def _load(args: argparse.Namespace):
    from common.config import ConfigError, load_config

    path, overrides = _split_config_args(args)
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        print("invalid configuration:", file=sys.stderr)
        for line in e.lines:
            print(f"  {line}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "config":
        from common.config import to_yaml

        print(to_yaml(_load(args)), end="")
        return 0
    if args.command == "toy-model":
        from common.toy_model import ensure_toy_model

        cfg = _load(args)
        ensure_toy_model(cfg.model, cfg.data, force=args.force, verbose=True)
        return 0
    if args.command == "train":
        from cluster.auth import use_token_auth_when_connecting

        use_token_auth_when_connecting()  # joining cluster.address needs it; an embedded Ray sets it anyway
        from cluster.driver import train_main

        return train_main(None if args.resume else _load(args), resume=args.resume)
    if args.command == "eval":
        from cluster.evaluate import eval_main

        return eval_main(args, _load(args))
    if args.command == "scale":
        from cluster.scale import scale_main

        return scale_main(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
