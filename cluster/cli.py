"""`exgrpo` command line. Thin: parse, load config, hand over. Heavy imports happen after parsing."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common.import_cost import skip_sklearn_in_transformers


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="exgrpo", description="ExGRPO: RLVR with managed experience replay on Ray.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    _add_train_and_config(sub)
    _add_eval(sub)
    _add_experiment(sub)
    _add_run_tools(sub)
    return p


def _add_train_and_config(sub) -> None:
    """train, config, toy-model: a config file and dotted overrides each."""
    t = sub.add_parser("train", help="train with ExGRPO (no arguments: the built-in task on this machine)")
    t.add_argument("config", nargs="?", help="YAML config file (optional)")
    t.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. buffer.max_lag=0")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest usable checkpoint; "
                   "key=value overrides may change total_steps, checkpointing, tracking and resources only")
    t.add_argument("--profile", action="store_true", help="print where the run's wall time went (start-up phases, "
                   "per-step driver phases, generator engine/scoring/idle time); always saved as profile.json")

    c = sub.add_parser("config", help="print the resolved config as YAML")
    c.add_argument("config", nargs="?", help="YAML config file (optional)")
    c.add_argument("overrides", nargs="*", help="dotted.key=value overrides")

    m = sub.add_parser("toy-model", help="build (or reuse) the built-in model and print its accuracy spread")
    m.add_argument("config", nargs="?", help="YAML config file (optional)")
    m.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    m.add_argument("--force", action="store_true", help="rebuild even when cached")


def _add_eval(sub) -> None:
    e = sub.add_parser("eval", help="greedy and sampled accuracy of a model on a test split or the eval.sets")
    e.add_argument("--model", required=True, help="Hugging Face model folder")
    e.add_argument("--task", choices=["countdown", "arithmetic", "think_arith"],
                   help="built-in task (default: the config's); its reward and chat settings come with it")
    e.add_argument("--data", help="JSONL/Parquet test file (instead of a built-in task)")
    e.add_argument("--samples", type=_positive, default=None,
                   help="samples per question for pass@k (default: eval.samples, 4, as the in-run evaluator; "
                        "each eval.sets entry's own)")
    e.add_argument("--limit", type=_positive, default=None, help="evaluate at most this many questions")
    e.add_argument("config", nargs="?", help="YAML config file (optional)")
    e.add_argument("overrides", nargs="*", help="dotted.key=value overrides")


def _add_experiment(sub) -> None:
    x = sub.add_parser("experiment", help="variants x seeds at an equal rollout budget: a table and a plot",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bundled = sorted(f.stem for f in (Path(__file__).resolve().parent / "experiments").glob("*.yaml"))
    x.add_argument("spec", help=f"experiment spec YAML, or a bundled spec name: {', '.join(bundled)} "
                   "(cluster/experiments/)")
    x.add_argument("--runs-root", default="runs", help="parent of the run folders and of the MLflow store")
    x.add_argument("--jobs", type=_positive, default=1, help="runs at a time (each is an `exgrpo train`)")
    x.add_argument("--rerun", action="store_true", help="rerun variants that already finished")
    x.add_argument("--variants", nargs="+", metavar="NAME", help="run only these variants of the spec (default: all)")
    x.add_argument("--seeds", nargs="+", type=int, metavar="N",
                   help="these seeds instead of the spec's (finished runs are reused; more seeds narrow the "
                   "intervals) (default: the spec's)")


def _add_run_tools(sub) -> None:
    """extend-context (a model folder), track and scale (a running or finished run)."""
    g = sub.add_parser("extend-context", help="copy a model folder with longer positions (config.json's "
                       "max_position_embeddings and rope_theta, as the LUFFY/ExGRPO recipe does; weights linked)")
    g.add_argument("src", help="the model folder (Hugging Face layout)")
    g.add_argument("dst", help="the new folder (must not exist)")
    g.add_argument("--max-positions", type=_positive, required=True,
                   help="config.json's new max_position_embeddings, e.g. 16384")
    g.add_argument("--rope-theta", type=_positive_float, default=None,
                   help="config.json's new rope_theta (RoPE base), e.g. 40000 (default: unchanged)")
    g.add_argument("--copy", action="store_true", help="copy the weights and tokenizer instead of linking them")

    k = sub.add_parser("track", help="send a run's metric points that its MLflow store did not take")
    k.add_argument("--replay", metavar="RUN_DIR", required=True,
                   help="the run folder whose metrics-unsent.jsonl goes into its MLflow run (then removed)")

    s = sub.add_parser("scale", help="change the number of generator actors of a running job")
    s.add_argument("--generators", type=_non_negative, default=None, help="target number of generators")
    s.add_argument("--min-generators", type=_non_negative, default=None,
                   help="new cluster.autoscale.min_generators of the running job")
    s.add_argument("--max-generators", type=_non_negative, default=None,
                   help="new cluster.autoscale.max_generators of the running job")
    s.add_argument("--run", required=True, help="run name (as printed by `exgrpo train`)")
    s.add_argument("--address", default=None,
                   help="Ray address of the running job (default: the one in its run folder, else auto)")
    s.add_argument("--namespace", default="exgrpo", help="Ray namespace of the run")
    s.add_argument("--runs-root", default="runs", help="parent of run folders (to find the run's Ray address)")


def _version() -> str:
    """The installed package's version (pyproject.toml's, once `pip install` ran)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("exgrpo")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _positive(text: str) -> int:
    return _int_at_least(text, 1)


def _positive_float(text: str) -> int | float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return int(x) if x.is_integer() else x  # 40000 stays 40000 in config.json


def _non_negative(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"{n} is less than {low}")
    return n


def _split_config_args(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """argparse cannot tell `train a=b` (no file) from `train file.yaml`: a first token without `=` is the
    config file unless it reads as a dotted key. Tokens that are not key=value raise ConfigError with the
    override they were probably meant to be (`buffer.group_size 8` -> `buffer.group_size=8`)."""
    from common.config import ConfigError

    items = ([args.config] if args.config else []) + list(args.overrides)
    path = None
    if items and "=" not in items[0] and not _reads_as_key(items[0]):
        path, items = items[0], items[1:]
    problems = _not_overrides(items, path)
    if problems:
        if path is not None and not Path(path).is_file():
            problems.insert(0, f"{path}: is a folder; pass a YAML config file" if Path(path).is_dir()
                            else f"{path}: config file not found")
        raise ConfigError(problems)
    return path, items


def _reads_as_key(token: str) -> bool:
    """`buffer.group_size` or `total_steps`, not an existing file nor a `.yaml` path."""
    if Path(token).exists() or token.endswith((".yaml", ".yml", ".json")):
        return False
    return all(part.isidentifier() for part in token.partition(":")[0].split("."))  # `key:value` is one too


def _not_overrides(items: list[str], path: str | None = None) -> list[str]:
    """One problem per token that is not key=value, naming the override it was probably meant to be."""
    from common.config import RunConfig
    from common.config.loading import colon_override

    problems, i = [], 0
    while i < len(items):
        tok, nxt, after = (items[i:i + 3] + [None, None])[:3]
        if "=" in tok and not tok.endswith("=") and not tok.startswith("="):
            i += 1
            continue
        if "=" not in tok and (Path(tok).is_file() or tok.endswith((".yaml", ".yml"))):  # a second config file
            first = f" (the config is {path})" if path else ""
            problems.append(f"{tok}: one config file per command{first}; merge the files, or give {tok}'s settings "
                            "as key=value overrides" if Path(tok).is_file() else f"{tok}: config file not found")
            i += 1
            continue
        if colon_override(tok, nxt):  # `key:8`, `key: 8`: YAML's form
            guess, i = colon_override(tok, nxt)[0], i + colon_override(tok, nxt)[1]
        elif tok.endswith("=") and nxt is not None and "=" not in nxt:  # `key= 8`
            guess, i = tok + nxt, i + 2
        elif nxt == "=" and after is not None and tok and "=" not in tok:  # `key = 8`
            guess, i = f"{tok}={after}", i + 3
        elif nxt is not None and nxt.startswith("=") and "=" not in tok:  # `key =8`
            guess, i = tok + nxt, i + 2
        elif nxt is not None and "=" not in tok and "=" not in nxt:  # `key 8`
            guess, i = f"{tok}={nxt}", i + 2
        elif "=" not in tok and tok.split(".")[0] in RunConfig.model_fields:  # `key` alone
            guess, i = f"{tok}=<value>", i + 1
        else:  # `=8`, `key=` with nothing after, or a word that is neither a file nor a field
            why = "no value after '=' (write null for none)" if tok.endswith("=") and tok != "=" else (
                "not a config file that exists, nor an override" if "=" not in tok else "no key before '='")
            problems.append(f"{tok}: an override is written key=value, e.g. buffer.group_size=8 ({why})")
            i += 1
            continue
        problems.append(f"overrides are written key=value: did you mean {guess}?")
    return problems


def _load(args: argparse.Namespace):
    from common.config import ConfigError, load_config

    try:
        path, overrides = _split_config_args(args)
        return load_config(path, overrides)
    except ConfigError as e:
        _exit_invalid(e)


def _secrets_back(cfg):
    """A new run given a redacted tracking.uri (`exgrpo experiment` passes its runs the password in the environment,
    not on their command lines): its password from MLFLOW_TRACKING_PASSWORD, or one line saying how to give it."""
    from common.config import ConfigError, restore_secrets

    try:
        return restore_secrets(cfg)
    except ConfigError as e:
        _exit_invalid(e)


def _exit_invalid(e) -> None:
    print("invalid configuration:", file=sys.stderr)
    for line in e.lines:
        print(f"  {line}", file=sys.stderr)
    raise SystemExit(2) from None


def _resume_overrides(args: argparse.Namespace) -> list[str]:
    """`train --resume RUN key=value ...`: the run's own config.yaml is the base, so no config file."""
    from common.config import ConfigError

    try:
        path, overrides = _split_config_args(args)
    except ConfigError as e:
        _exit_invalid(e)
    if path is not None:
        _exit_invalid(ConfigError([f"{path}: --resume continues with the run's own config.yaml; pass only "
                                   "key=value overrides (see `exgrpo train --help`)"]))
    return overrides


def _resumed_address(args: argparse.Namespace) -> str | None:
    """cluster.address of the run `--resume` continues (None when its config cannot be read: train reports why)."""
    from common.config import ConfigError, load_saved_config, resume_config

    try:
        saved = load_saved_config(Path(args.resume) / "config.yaml")[0]
        return resume_config(saved, _split_config_args(args)[1])[0].cluster.address
    except (ConfigError, OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    skip_sklearn_in_transformers()  # 2.6 s of the driver's start where MLflow installed scikit-learn
    _refuse_dashed_overrides(sys.argv[1:] if argv is None else [str(a) for a in argv])
    args = _parser().parse_args(argv)
    _current_folder_importable()
    try:
        return _dispatch(args)
    except KeyboardInterrupt:  # e.g. Ctrl-C while the built-in model builds: no traceback
        print(f"exgrpo {args.command}: interrupted", file=sys.stderr)
        return 130


def _refuse_dashed_overrides(argv: list[str]) -> None:
    """`--buffer.group_size=8`: an override written as an option (argparse would answer "unrecognized arguments")."""
    if not any(a.startswith("--") and {".", "_"} & set(a.partition("=")[0]) for a in argv):
        return  # no option that could be a field (ours are dashed words): no config import
    from common.config import ConfigError
    from common.config.loading import dashed_overrides

    if dashed_overrides(argv):
        _exit_invalid(ConfigError(dashed_overrides(argv)))


def _current_folder_importable() -> None:
    """The folder the command runs in is importable, as with `python -m`: a reward module `my_rewards.py` there is
    found by reward.name=my_rewards:fn (`.venv/bin/exgrpo` alone puts only its own folder on sys.path). After the
    installed packages, so a file there named like one of them does not shadow it. The run ships the module to its
    Ray workers (`cluster.preflight.user_modules`)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _eval_args(args: argparse.Namespace) -> argparse.Namespace:
    """`exgrpo eval`'s arguments with --data / --task written as overrides, so that they are the data of every
    check, the config's validation included (`cluster.evaluate.eval_overrides`)."""
    from cluster.evaluate import eval_overrides
    from common.config import ConfigError

    try:
        args.config, overrides = _split_config_args(args)
    except ConfigError as e:
        _exit_invalid(e)
    args.overrides = eval_overrides(args.data, args.task, overrides)
    return args


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "config":
        return _config_main(args)
    if args.command == "toy-model":
        from common.toy_model import ensure_toy_model

        cfg = _load(args)
        ensure_toy_model(cfg.model, cfg.data, force=args.force, verbose=True)
        return 0
    if args.command == "train":
        _private_files()
        return _train_main(args)
    if args.command == "eval":
        from cluster.evaluate import eval_main

        return eval_main(args, _load(_eval_args(args)))
    if args.command == "experiment":
        from cluster.experiment import experiment_main

        _private_files()
        return experiment_main(args.spec, args.runs_root, args.jobs, args.rerun, args.variants, args.seeds)
    if args.command == "extend-context":
        from cluster.extend_context import extend_context_main

        return extend_context_main(args)
    if args.command == "track":
        from cluster.tracking import replay_main

        return replay_main(args.replay)
    if args.command == "scale":
        from cluster.scale import scale_main

        return scale_main(args)
    raise AssertionError(args.command)


def _private_files() -> None:
    """Files a run writes are the user's alone (0600, folders 0700): the umask is set before anything is written or
    started, so the embedded Ray's processes (learner ranks writing checkpoints) and `exgrpo experiment`'s runs
    inherit it. A joined cluster's processes keep their own."""
    os.umask(0o077)


def _config_main(args: argparse.Namespace) -> int:
    """`exgrpo config`: the resolved config as YAML, then what `exgrpo train`'s start checks would say of it."""
    from cluster.preflight import BadInput, check_start, gpus_missing
    from common.config import to_yaml

    cfg = _load(args)
    print(to_yaml(cfg), end="")
    print(f"# learner: {cfg.learner.loss_scale()}")  # derived (a YAML comment: the output still loads)
    gpus = gpus_missing(cfg)
    if gpus:  # valid, and what a GPU machine runs; `exgrpo train` here refuses it
        print(f"warning: exgrpo train refuses this config on this machine: {gpus}", file=sys.stderr)
    try:  # the start checks of `exgrpo train` (cluster.preflight.check_start), the built-in model unbuilt
        start = check_start(cfg, build_model=False)
    except BadInput as e:  # valid as a config, but `train` would stop at its start
        from common.config.secrets import redact

        print("exgrpo train refuses this config on this machine (its start checks: the run folder, the model "
              "folder, the data and the reward):", *map(redact, e.lines or [e.heading]), sep="\n  ", file=sys.stderr)
        return 2
    if start.model_path is None:
        print("note: the built-in model is not built yet (exgrpo toy-model builds it, in minutes): the prompts are "
              "tokenised and checked against data.max_prompt_tokens once it is", file=sys.stderr)
    return 0


def _train_main(args: argparse.Namespace) -> int:
    from cluster.auth import ClusterAuthError, use_token_auth_when_connecting

    cfg = None if args.resume else _secrets_back(_load(args))
    try:  # before ray is imported: join cluster.address in the mode that cluster uses
        use_token_auth_when_connecting(cfg.cluster.address if cfg else _resumed_address(args))
    except ClusterAuthError as e:
        print(f"error: cluster.address: {e}", file=sys.stderr)
        return 2
    from cluster.run import train_main
    from common.config.secrets import redact

    command = redact("exgrpo " + " ".join(sys.argv[1:]))  # --profile prints it
    if args.resume:
        return train_main(None, resume=args.resume, overrides=_resume_overrides(args), show_profile=args.profile,
                          command=command)
    return train_main(cfg, show_profile=args.profile, command=command)


if __name__ == "__main__":
    sys.exit(main())
