"""Docs as tests: every line README.md and docs/*.md show works (issue 37).

Collected from the Markdown source:
- every `exgrpo ...` command in a code block or an inline span: its subcommand and flags exist (the argument
  parser of `exgrpo`), and its key=value overrides validate together through the same loading `exgrpo config`
  uses (`--resume` lines through the resume rules, on a default run). A command shown failing (the next line
  reads "invalid configuration:") must fail with the lines shown;
- every inline `key=value` span (several overrides in one span validate together) and every inline
  `section.key: value` span;
- every inline dotted key whose first part is a config section (`buffer.max_lag`): it names a field or
  section a user can type;
- every YAML block that is a run config (loads) or an experiment spec (every variant validates).
- docs/own-task.md (issue 45): its JSONL rows load as data, each bundled reward's table row scores 1 with its
  response, and its reward module imports through `reward.name` and passes the page's doctest.

Placeholders (`<run>`, `...`, `PATH`) are not values: their keys are checked, not their values. A config file
the docs do not ship (`my_run.yaml`) stands for the user's model and data. The override spans of one source line
validate together; a paragraph whose overrides need a context names it
(`<!-- doc-test: with data.task=think_arith -->`); a line meant to show a refusal in prose carries
`<!-- doc-test: refused -->` (and must be refused). An inline command names a subcommand and its flags (checked
by name); a command in a code block must parse as written. Relative data files named by the docs are created
(empty) in a scratch folder, since loading checks that eval sets exist. In-process: no subprocess per line.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from cluster.cli import _parser, _split_config_args
from common.config import ConfigError, RunConfig, load_config, resume_config
from common.config.schema import leaf_paths, mapping_value, section_paths, union_kinds

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = set(RunConfig.model_fields)
REFUSED = "<!-- doc-test: refused -->"
CONTEXT = re.compile(r"<!-- doc-test: with (.*?) -->", flags=re.S)
CONFIG_COMMANDS = ("train", "config", "toy-model", "eval")
DATA_FILE = re.compile(r"^[\w./-]+\.(jsonl|json|parquet)$")
OVERRIDE = re.compile(r"^[a-z_][a-z0-9_]*(\.[^\s=]+)*=\S*$")
DOTTED_KEY = re.compile(r"^[a-z_][a-z0-9_]*(\.(<name>|[a-z0-9_]+))+\.?\*?$")


def _placeholder(value: str) -> bool:
    return value in ("", "...", "F", "N", "k", "PATH", "value") or "<" in value or value.endswith("...")


def _doc_lines(doc: Path) -> list[str]:
    return doc.read_text().splitlines()


# ------------------------------------------------------------------------------------------- collecting


def code_blocks(doc: Path) -> list[tuple[int, str, list[str]]]:
    """(first line number, language, lines) of each fenced block."""
    out, lang, start, body = [], None, 0, []
    for n, line in enumerate(_doc_lines(doc), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip(), n + 1, []
            else:
                out.append((start, lang, body))
                lang = None
        elif lang is not None:
            body.append(line)
    return out


def _command_words(text: str) -> list[str] | None:
    """The words after `exgrpo` in a shell line (None: not an exgrpo command); comments and pipes cut off."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    idx = next((i for i, w in enumerate(words) if w == "exgrpo" or w.endswith("/exgrpo")), None)
    if idx is None:
        return None
    words = words[idx + 1:]
    cut = next((i for i, w in enumerate(words) if w in ("|", ">", "2>", "&&", ";", "||")), len(words))
    return [w.strip("[]") for w in words[:cut] if w.strip("[]") and w != "|"]


def commands() -> list[tuple[str, list[str], list[str] | None]]:
    """(where, words after `exgrpo`, the error lines shown after it or None) for every command the docs show."""
    out = []
    for doc in DOCS:
        for start, lang, body in code_blocks(doc):
            joined: list[tuple[int, str]] = []
            for i, line in enumerate(body):
                if joined and joined[-1][1].endswith("\\"):
                    joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + line.strip())
                else:
                    joined.append((start + i, line))
            for k, (n, line) in enumerate(joined):
                prompt = line.lstrip().startswith("$ ")
                if not prompt and lang not in ("bash", "sh", "shell", ""):
                    continue
                words = _command_words(line.lstrip().removeprefix("$ "))
                if not words or not (prompt or line.lstrip().split()[0].endswith("exgrpo")
                                     or "--" in line.split("exgrpo")[0]):
                    continue
                shown = None
                if k + 1 < len(joined) and joined[k + 1][1].strip() == "invalid configuration:":
                    shown = []
                    for _, nxt in joined[k + 2:]:
                        if not nxt.startswith("  "):
                            break
                        shown.append(nxt.strip())
                out.append((f"{doc.name}:{n}", words, shown))
        for n, line, span in inline_spans(doc):
            if span.startswith("exgrpo ") and REFUSED not in line:
                words = _command_words(span)
                if words:
                    out.append((f"{doc.name}:{n}", words, "inline"))
    return out


def inline_spans(doc: Path) -> list[tuple[int, str, str]]:
    """(line number, source line, text) of every inline code span outside code blocks; a span may wrap."""
    text = doc.read_text()
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    lines = text.splitlines()
    out = []
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
        n = text.count("\n", 0, m.start()) + 1
        out.append((n, lines[n - 1], " ".join(m.group(1).split())))
    return out


def contexts(doc: Path) -> dict[int, list[str]]:
    """line number -> the overrides its paragraph's `<!-- doc-test: with ... -->` marker names."""
    out: dict[int, list[str]] = {}
    lines = _doc_lines(doc)
    start = 0
    for n in range(len(lines) + 1):
        if n == len(lines) or not lines[n].strip():
            paragraph = "\n".join(lines[start:n])
            given = [w for m in CONTEXT.finditer(paragraph) for w in m.group(1).split()]
            out.update({k + 1: given for k in range(start, n)} if given else {})
            start = n + 1
    return out


def inline_overrides() -> list[tuple[str, list[str]]]:
    """(where, overrides) of every source line's spans made of key=value words (or one `dotted.key: value`),
    after the overrides of its paragraph's context."""
    out: dict[str, list[str]] = {}
    for doc in DOCS:
        context = contexts(doc)
        for n, line, span in inline_spans(doc):
            if span.startswith("exgrpo "):
                continue
            words = span.split()
            colon = re.fullmatch(r"([a-z_]+\.[a-z0-9_.]+): (\S+)", span)
            if colon:
                words = [f"{colon.group(1)}={colon.group(2)}"]
            if words and all(OVERRIDE.match(w) and w.split(".")[0].split("=")[0] in SECTIONS for w in words):
                where = f"{doc.name}:{n}" + (" (refused)" if REFUSED in line else "")
                out.setdefault(where, list(context.get(n, []))).extend(words)
    return list(out.items())


def inline_keys() -> list[tuple[str, str]]:
    """(where, key) of every span that is one dotted key starting with a config section."""
    out = []
    for doc in DOCS:
        for n, line, span in inline_spans(doc):
            for word in span.replace(",", " ").replace("/", " / ").split() if " " in span else [span]:
                if DOTTED_KEY.match(word) and word.split(".")[0] in SECTIONS and REFUSED not in line \
                        and not _a_module(word):
                    out.append((f"{doc.name}:{n}", word))
    return out


def _a_module(word: str) -> bool:
    """`cluster.preflight` names a module of ours, not a field."""
    return (ROOT / (word.replace(".", "/") + ".py")).is_file()


# ------------------------------------------------------------------------------------------- checking


TYPEABLE = {p for p, _ in leaf_paths()} | set(section_paths())


def key_exists(key: str) -> bool:
    """A field or section a user can type (`eval.sets.aime.path`, `generator.node_labels.<key>` included)."""
    key = key.removesuffix("*").removesuffix(".")
    if key in TYPEABLE or key in SECTIONS:
        return True
    parts = key.split(".")
    named = re.sub(r"^eval\.sets\.[^.]+", "eval.sets.<name>", key)
    if named in TYPEABLE or (key.startswith("eval.sets.") and len(parts) == 3):
        return True
    for i in range(1, len(parts)):  # a key below a mapping of values
        if ".".join(parts[:i]) in TYPEABLE and _is_mapping(".".join(parts[:i])):
            return True
    return False


def _is_mapping(path: str) -> bool:
    models = [RunConfig]
    *sections, name = path.split(".")
    for s in sections:
        fields = [m.model_fields[s] for m in models if s in m.model_fields]
        models = [m for f in fields for m in ((union_kinds(f) or {}).values() or [f.annotation])
                  if isinstance(m, type) and issubclass(m, BaseModel)]
    return any(mapping_value(m.model_fields[name].annotation)[0] for m in models if name in m.model_fields)


def _make_data_files(overrides: list[str]) -> None:
    for o in overrides:
        value = o.partition("=")[2]
        if DATA_FILE.match(value) and not value.startswith("/") and not Path(value).exists():
            Path(value).parent.mkdir(parents=True, exist_ok=True)
            Path(value).write_text("")


def _subparsers() -> dict:
    import argparse

    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def check_names(words: list[str]) -> None:
    """The subcommand and every flag exist (by their full names: a prose mention is not a command line)."""
    if words[0].startswith("-"):  # `exgrpo --version`: a flag of exgrpo itself
        unknown = [w for w in words if w.split("=")[0] not in _parser()._option_string_actions]
        if unknown:
            raise ConfigError([f"{' '.join(unknown)}: not a flag of exgrpo"])
        return
    sub = _subparsers().get(words[0])
    if sub is None:
        raise ConfigError([f"{words[0]}: no such exgrpo subcommand"])
    unknown = [w for w in words[1:] if w.startswith("-") and w.split("=")[0] not in sub._option_string_actions]
    if unknown:
        raise ConfigError([f"{' '.join(unknown)}: not a flag of exgrpo {words[0]}"])


def validate(words: list[str], parse: bool = True) -> None:
    """Parse `exgrpo WORDS` as the CLI does and validate its config (ConfigError or SystemExit when refused)."""
    check_names(words)
    if words[0].startswith("-"):  # a flag of exgrpo itself (--version, --help): nothing to validate
        return
    if not parse:  # an inline mention: its overrides, with what the subcommand needs filled in
        words = [words[0], *(["--model", "m"] if words[0] == "eval" else []), *[w for w in words[1:] if "=" in w]]
    args = _parser().parse_args([("x" if _placeholder_word(w) else w) for w in words] + _required(words))
    if args.command not in CONFIG_COMMANDS:
        return
    given = [a for a in ([args.config] if args.config else []) + list(args.overrides) if a != "..."]
    if args.command == "eval" and args.task and not args.data:
        given += [f"data.task={args.task}", "data.train_path=null"]
    for w in given:  # placeholders: the key must exist, the value is the user's
        if "=" in w and _placeholder(w.partition("=")[2]) and w != "key=value":
            assert key_exists(w.partition("=")[0]), f"{w}: no such field"
    given = [w for w in given if not ("=" in w and _placeholder(w.partition("=")[2]))]
    args.config, args.overrides = (given[0] if given else None), given[1:]
    path, overrides = _split_config_args(args)
    _make_data_files(overrides)
    if getattr(args, "resume", None):
        resume_config(load_config(), overrides)
    elif path is not None and not (ROOT / path).is_file():  # the user's config: their model and data
        load_config(None, ["data.train_path=questions.jsonl", *overrides])
    else:
        load_config(ROOT / path if path else None, overrides)


def _placeholder_word(w: str) -> bool:
    return w in ("PATH", "RUN") or (w.startswith("<") and w.endswith(">")) or ("<" in w and "=" not in w)


def _required(words: list[str]) -> list[str]:
    """Required flags a usage line leaves out (`exgrpo scale --generators 3` in prose has --run)."""
    return [] if "--run" in words or not words or words[0] != "scale" else ["--run", "r"]


def test_the_docs_show_commands_overrides_keys_and_configs():
    assert len(commands()) > 20 and len(inline_overrides()) > 30 and len(inline_keys()) > 50


def test_every_exgrpo_command_the_docs_show_parses_and_validates(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    problems = []
    for where, words, shown in commands():
        try:
            if shown == "inline":
                shown = None
                check_names(words)
                if any("=" in w for w in words[1:]):
                    validate(words, parse=False)
            else:
                validate(words)
            refusal = None
        except ConfigError as e:
            refusal = e.lines
        except SystemExit:  # argparse: an unknown subcommand or flag
            refusal = [capsys.readouterr().err.strip().splitlines()[-1]]
        if shown is None and refusal:
            problems.append(f"{where}: exgrpo {' '.join(words)}: {refusal}")
        elif shown is not None and (refusal is None or not all(s in refusal for s in shown)):
            problems.append(f"{where}: exgrpo {' '.join(words)}: the docs show {shown}, it gives {refusal}")
    assert not problems, "\n".join(problems)


def test_every_inline_override_validates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    problems = []
    for where, words in inline_overrides():
        for w in words:
            if _placeholder(w.partition("=")[2]) and w != "key=value" and not key_exists(w.partition("=")[0]):
                problems.append(f"{where}: {w}: no such field")
        words = [w for w in words if not _placeholder(w.partition("=")[2])]
        _make_data_files(words)
        try:
            load_config(None, words)
            if where.endswith("(refused)"):
                problems.append(f"{where}: {' '.join(words)}: the docs say this is refused; it is accepted")
        except ConfigError as e:
            if not where.endswith("(refused)"):
                problems.append(f"{where}: {' '.join(words)}: {e.lines}")
    assert not problems, "\n".join(problems)


def test_every_dotted_key_the_docs_name_exists():
    problems = [f"{where}: {key}" for where, key in inline_keys() if not key_exists(key)]
    assert not problems, "no such field:\n" + "\n".join(problems)


def test_every_yaml_block_loads(tmp_path, monkeypatch):
    from cluster.experiment import load_spec

    monkeypatch.chdir(tmp_path)
    problems, checked = [], 0
    for doc in DOCS:
        for start, lang, body in code_blocks(doc):
            if lang not in ("yaml", "yml"):
                continue
            block = yaml.safe_load("\n".join(body))
            f = tmp_path / "block.yaml"
            f.write_text("\n".join(body))
            try:
                if isinstance(block, dict) and {str(k).split(".")[0] for k in block} <= SECTIONS:
                    load_config(f)
                elif isinstance(block, dict) and "variants" in block:
                    load_spec(str(f))
                else:
                    continue  # not ours (a RayJob manifest)
                checked += 1
            except (ConfigError, ValueError) as e:
                problems.append(f"{doc.name}:{start}: {getattr(e, 'lines', e)}")
    assert checked >= 2 and not problems, "\n".join(problems)


def test_the_resume_list_is_generated_from_resumable_fields():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = (ROOT / "docs" / "reference.md").read_text()
    assert gen.RESUME_START in text, "docs/reference.md lost its generated resume list"
    assert gen.doc_with_resume_fields(text) == text, (
        "docs/reference.md's resume list is stale: run `python scripts/gen_config_docs.py --resume-fields`")


@pytest.mark.parametrize("broken, found", [
    ("exgrpo config buffer.max_lagg=1", "buffer.max_lagg"),
    ("exgrpo train --profiles", "--profiles"),
    ("exgrpo config learner.loss.clip_fresh=maybe", "learner.loss.clip_fresh"),
])
def test_a_broken_doc_line_is_caught(broken, found):
    """The checks above see a wrong key or flag (the same path they take for a real doc line)."""
    with pytest.raises((ConfigError, SystemExit)) as e:
        validate(_command_words(broken))
    assert e.type is SystemExit or found in str(e.value)


# ------------------------------------------------------------------------------------------- docs/own-task.md

OWN_TASK = ROOT / "docs" / "own-task.md"


def _own_task_rows() -> list[dict]:
    """The example rows of the page's JSONL block."""
    import json

    blocks = [body for _, lang, body in code_blocks(OWN_TASK) if lang == "jsonl"]
    assert blocks, "docs/own-task.md shows no JSONL block"
    return [json.loads(line) for body in blocks for line in body if line.strip()]


def test_own_task_rows_load_as_data(tmp_path):
    from common.config import DataConfig
    from common.data import read_rows

    rows = _own_task_rows()
    f = tmp_path / "math.jsonl"
    f.write_text(OWN_TASK.read_text().split("```jsonl\n")[1].split("```")[0])
    read = [row for _, row in read_rows(f)]
    fields = DataConfig()
    assert read == rows and len(rows) >= 2
    assert all(isinstance(r[fields.question_field], str) and isinstance(r[fields.answer_field], str) for r in rows)


def test_own_task_table_rows_score_one_with_their_bundled_reward():
    """Each row of the bundled-rewards table: its response scores 1 against its row's answer."""
    import json

    from common.reward_registry import BUILTIN_NAMES, resolve_reward

    seen = set()
    for line in _doc_lines(OWN_TASK):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`") or cells[0].strip("`") not in BUILTIN_NAMES:
            continue
        name, row, response = cells[0].strip("`"), json.loads(cells[2].strip("`")), cells[3][1:-1]
        fn, _ = resolve_reward(name)
        assert fn(response, row["answer"]) == 1.0, f"{name}: {response!r} against {row['answer']!r}"
        seen.add(name)
    assert seen == set(BUILTIN_NAMES), f"the table lacks {set(BUILTIN_NAMES) - seen}"


def test_own_task_reward_module_imports_and_scores_the_example(tmp_path, monkeypatch):
    """The page's module, saved under the name its first line gives, is found by `reward.name` as the run finds
    it, passes the page's doctest, and scores the example row whose answer is a number."""
    import doctest

    from common.reward_registry import resolve_reward

    blocks = [body for _, lang, body in code_blocks(OWN_TASK) if lang == "python"]
    module = next(b for b in blocks if b and re.fullmatch(r"# \w+\.py", b[0]))
    (tmp_path / module[0][2:]).write_text("\n".join(module) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    name = next(span for _, _, span in inline_spans(OWN_TASK) if span.startswith("reward.name=" + module[0][2:-3]))
    fn, in_process = resolve_reward(name.partition("=")[2])
    assert not in_process and fn.__module__ == module[0][2:-3]

    example = "\n".join(next(b for b in blocks if b and b[0].startswith(">>>")))
    test = doctest.DocTestParser().get_doctest(example, {}, "own-task.md", "own-task.md", 0)
    runner = doctest.DocTestRunner()
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0 and test.examples

    rows = _own_task_rows()  # every example row of the page, \frac{1}{2} included, in the forms a response takes
    for r in rows:
        for written in (r["answer"], _decimal(r["answer"])):
            assert fn(f"so it is \\boxed{{{written}}}.", r["answer"]) == 1.0, (written, r["answer"])
        assert fn(f"so it is \\boxed{{{_decimal(r['answer'])}1}}.", r["answer"]) == 0.0  # another number


def _decimal(answer: str) -> str:
    """`\\frac{1}{2}` -> `0.5`, `48` -> `48.0`: the answer as a response may write it."""
    m = re.fullmatch(r"\\frac\{(\d+)\}\{(\d+)\}", answer)
    return str(int(m[1]) / int(m[2])) if m else str(float(answer))


# ------------------------------------------------------------------ docs/own-task.md sections 3 and 4, as written

QWEN25_MATH_1_5B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.02, "intermediate_size": 8960,
    "max_position_embeddings": 4096, "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 12,
    "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "sliding_window": 4096, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.37.0",
    "use_cache": True, "use_mrope": False, "use_sliding_window": False, "vocab_size": 151936,
}
"""config.json of Qwen/Qwen2.5-Math-1.5B as the hub ships it (issue 51: max_position_embeddings 4096; the recipe's
rope_theta 10000 -> 40000)."""

TINY_WIDTH = {"hidden_size": 16, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "max_window_layers": 1}
"""The stand-in's only departures from that config.json: its width, so that its weights are a few MB."""


def _stand_in_qwen_math(folder: Path) -> Path:
    """A stand-in for the folder `hf download Qwen/Qwen2.5-Math-1.5B` makes: its config.json's values (positions,
    RoPE base, the 151,936-row vocabulary, tied embeddings, tokens, dtype) at the tiny width above, weights of that
    width (the embedding's 151,936 rows included), and a character tokenizer with a chat template."""
    import json

    import torch

    from common.modeling import CHAT_TEMPLATE, TinyQwen2, build_char_tokenizer, save_model_folder

    model = TinyQwen2(hidden_size=TINY_WIDTH["hidden_size"], intermediate_size=TINY_WIDTH["intermediate_size"],
                      num_layers=1, num_heads=2, num_kv_heads=1, max_positions=4096, rope_theta=10000.0).build()
    tok = build_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    save_model_folder(model.to(torch.bfloat16), tok, folder)
    (folder / "config.json").write_text(json.dumps({**QWEN25_MATH_1_5B_CONFIG, **TINY_WIDTH}, indent=2))
    return folder


def _section(doc: Path, heading: str) -> str:
    text = doc.read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def _block_after(section: str, marker: str, lang: str) -> str:
    """The first fenced block of `lang` after the text `marker` of `section`."""
    rest = section[section.index(marker) + len(marker):]
    return rest.split(f"```{lang}\n", 1)[1].split("```", 1)[0]


def test_own_task_section_4_works_as_written_on_the_models_real_config(tmp_path, monkeypatch, capsys):
    """Issue 51: section 4 against a stand-in for the model section 1 downloads (Qwen2.5-Math-1.5B's config.json,
    tiny weights), every /data path moved under a scratch folder: the model as downloaded is refused for its 4096
    positions; the page's `exgrpo extend-context` line makes the copy and prints what the page shows; the page's
    config then passes `exgrpo config` (the start checks of `exgrpo train`: the folder, its tokenizer and chat
    template, the data read and tokenised, the reward), with only the warning that this machine has no GPU."""
    import json

    from cluster.cli import main
    from cluster.console import setup_logging

    setup_logging(None)  # the console handler on this test's stderr (an earlier test's `exgrpo train` left one)
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    here = lambda text: text.replace("/data/", f"{data}/")  # noqa: E731
    _stand_in_qwen_math(data / "models" / "Qwen2.5-Math-1.5B")
    rows = OWN_TASK.read_text().split("```jsonl\n")[1].split("```")[0]
    for name in ("openr1_math.jsonl", "math500.jsonl"):
        (data / name).write_text(rows)
    section = _section(OWN_TASK, "## 4. ")
    config = tmp_path / "qwen_math.yaml"
    config.write_text(here(_block_after(section, "Save it as `qwen_math.yaml`", "yaml")))

    def exgrpo(words: list[str]) -> tuple[int, str, str]:
        try:
            code = main(words)
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return code, out.out, out.err

    code, _, err = exgrpo(["config", str(config), f"model.path={data}/models/Qwen2.5-Math-1.5B"])
    assert code == 2 and "generator.max_new_tokens: 8192 tokens do not fit" in err and "4096 positions" in err, err
    assert "exgrpo extend-context" in err, err

    block = _block_after(section, "Make that copy", "bash")
    (line,) = [w for w in block.splitlines() if "exgrpo extend-context" in w]
    assert line == _block_after(_section(ROOT / "docs" / "cluster.md", "## 4. "), "extend-context", "bash").strip()
    code, out, err = exgrpo(_command_words(here(line)))
    shown = _block_after(section, "--rope-theta 40000\n```", "")
    assert code == 0 and out == here(shown), out + err
    extended = data / "models" / "Qwen2.5-Math-1.5B-16k"
    cfg = json.loads((extended / "config.json").read_text())
    assert (cfg["max_position_embeddings"], cfg["rope_theta"]) == (16384, 40000)
    assert {k: v for k, v in cfg.items() if k not in ("max_position_embeddings", "rope_theta")} == \
        {k: v for k, v in {**QWEN25_MATH_1_5B_CONFIG, **TINY_WIDTH}.items() if k not in ("max_position_embeddings",
                                                                                          "rope_theta")}
    assert (extended / "model.safetensors").is_symlink()

    for line in _block_after(section, "then train:", "bash").splitlines():
        words = _command_words(line)
        if words and words[0] == "config":
            code, out, err = exgrpo(words)
            refused = [e for e in err.splitlines() if not e.startswith(("[exgrpo] ", "warning: exgrpo train refuses "
                                                                        "this config on this machine: learner.num_gpus=1"))]
            assert code == 0 and not refused, err
            assert f"path: {extended}" in out


def test_own_task_section_3_runs_from_the_folder_that_holds_the_module(tmp_path):
    """Issue 51: "start the run from the folder that holds my_rewards.py", as written: the page's module and data
    in a folder, the page's `exgrpo config` line run there by `.venv/bin/exgrpo` (no PYTHONPATH) passes; its
    `exgrpo train` line gets past the reward's import (stopped right after it by a runs_root that is a file, before
    anything starts)."""
    import os
    import subprocess
    import sys

    blocks = [body for _, lang, body in code_blocks(OWN_TASK) if lang == "python"]
    module = next(b for b in blocks if b and re.fullmatch(r"# \w+\.py", b[0]))
    (tmp_path / module[0][2:]).write_text("\n".join(module) + "\n")
    (tmp_path / "math.jsonl").write_text(OWN_TASK.read_text().split("```jsonl\n")[1].split("```")[0])
    (tmp_path / "a-file").write_text("")
    _stand_in_qwen_math(tmp_path / "data" / "models" / "Qwen2.5-Math-1.5B")  # section 1's download
    section = _section(OWN_TASK, "## 3. ")
    lines = [w for w in _block_after(section, "How the module reaches the workers", "bash").splitlines()
             if _command_words(w)]
    assert [_command_words(w)[0] for w in lines] == ["config", "train"]
    assert all("model.path=/data/models/Qwen2.5-Math-1.5B" in w for w in lines)  # complete: your model, not ours
    exgrpo = Path(sys.executable).parent / "exgrpo"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for line in lines:
        words = _command_words(line.replace("/data/", f"{tmp_path}/data/"))
        extra = ["checkpoint.runs_root=a-file"] if words[0] == "train" else []
        p = subprocess.run([str(exgrpo), *words, *extra], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
        out = p.stdout + p.stderr
        assert "cannot import module" not in out and "Traceback" not in out, out
        assert "trains the built-in" not in out, out
        if words[0] == "config":
            assert p.returncode == 0, out
        else:
            assert p.returncode == 2 and "checkpoint.runs_root:" in out and "is a file" in out, out
