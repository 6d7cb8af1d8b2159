"""Questions from a built-in task or a JSONL/Parquet file, validated row by row.

`load_questions(data_cfg, tokenizer, split)` is the one entry point; built-in tasks (when
`data.train_path` is None) go through the same row checks as files. A failing row is skipped and reported
as `"<source> line N: problem"` (with `data.strict` the whole load fails with `DataError`).
`encode_prompt` turns a question into prompt ids, with or without the tokenizer's chat template; the built-in
model is trained on this same encoding.

Details (the row rules, derived ids, prompt encoding): docs/internals.md#commondatapy
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from common.config import DataConfig
from common.messages import Question, int32_array

MAX_REPORTED_PROBLEMS = 50
"""Problem lines kept in a LoadReport; further bad rows are only counted."""


class DataError(ValueError):
    """A dataset cannot be loaded (missing file, unreadable format, or a bad row in strict mode)."""


@dataclass
class LoadReport:
    """What a load did: rows seen, questions loaded, rows skipped, and why (first MAX_REPORTED_PROBLEMS)."""

    total: int = 0
    loaded: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)
    too_long: int = 0  # of the skipped rows: prompts over data.max_prompt_tokens
    max_prompt_tokens: int = 0

    def summary(self) -> str:
        long = (f" ({self.too_long} of them with a prompt over data.max_prompt_tokens={self.max_prompt_tokens})"
                if self.too_long else "")
        return f"{self.loaded}/{self.total} questions loaded, {self.skipped} rows skipped{long}"


def load_questions(
    data_cfg: DataConfig, tokenizer: Any, split: Literal["train", "test"], cache_dir: str | None = None
) -> tuple[list[Question], LoadReport]:
    """Questions of `split` and a report of skipped rows.

    Built-in task when `data_cfg.train_path` is None, else the configured file. A file-based config
    without `test_path` has an empty test split (the report says so). Raises DataError for a missing
    or unreadable file, or, in strict mode, for the first bad row. `cache_dir`: where a built-in task's questions
    are kept between runs (model.cache_dir, beside its built-in model).
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if data_cfg.train_path is None:
        if data_cfg.task is None:
            raise DataError("data: set data.task to a built-in task or data.train_path to a file")
        from common.tasks import get_task

        task = get_task(data_cfg.task)
        train, test = task.generate(data_cfg.seed, data_cfg.num_train, data_cfg.num_test, cache_dir)
        rows = train if split == "train" else test
        source = f"{task.name}:{split}"
        numbered = ((i + 1, row) for i, row in enumerate(rows))
        return _build(numbered, data_cfg, tokenizer, source, task.name, builtin=True)
    path = data_cfg.train_path if split == "train" else data_cfg.test_path
    if path is None:
        return [], LoadReport(problems=["no test split: data.test_path is not set"])
    return _build(read_rows(path), data_cfg, tokenizer, Path(path).name, Path(path).stem, builtin=False)


def read_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line or row number from 1, parsed row) of a `.jsonl`/`.json` or `.parquet` file.

    A JSONL line that is not valid JSON yields a `_BadRow` so that it is reported with its number.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{p}: dataset file not found")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return _jsonl_rows(p)
    if suffix in (".parquet", ".pq"):
        return _parquet_rows(p)
    if suffix in (".gz", ".bz2", ".xz", ".zst", ".zip"):
        inner = Path(p.stem).suffix or "?"
        raise DataError(f"{p}: a compressed file ({suffix}); data files are read uncompressed (JSONL or Parquet): "
                        f"decompress it and name the {inner} file, or save it as Parquet (compressed inside)")
    raise DataError(f"{p}: unknown dataset format {suffix!r}; use .jsonl or .parquet")


@dataclass(frozen=True)
class _BadRow:
    problem: str


def _jsonl_rows(p: Path) -> Iterator[tuple[int, Any]]:
    first = True
    with p.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except UnicodeDecodeError as e:
                row = _BadRow(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}): the file has "
                              "another encoding (latin-1?); re-save it as UTF-8")
            except (json.JSONDecodeError, RecursionError) as e:
                if first:
                    _refuse_one_document(p)
                row = _BadRow(f"not valid JSON ({type(e).__name__})")
            first = False
            yield n, row


def _refuse_one_document(p: Path) -> None:
    """DataError when the whole file is one JSON value spread over lines (a JSON array of rows, or one
    pretty-printed object), not JSON Lines: every line of it alone would be reported as invalid JSON."""
    try:
        whole = json.loads(p.read_bytes())
    except (ValueError, RecursionError):
        return  # not one document either: report the lines
    fix = (f"JSON Lines is one object per line; convert it with python -c \"import json, sys; [print(json.dumps(r)) "
           f"for r in json.load(open(sys.argv[1]))]\" {p} > {p.with_suffix('.jsonl').name}")
    if isinstance(whole, list):
        raise DataError(f"{p}: a JSON array of {len(whole)} items, not JSON Lines; {fix}")
    raise DataError(f"{p}: one JSON {type(whole).__name__ if not isinstance(whole, dict) else 'object'} spread over "
                    "several lines, not JSON Lines (one object per line, each a row with the question and answer "
                    "fields)")


def _parquet_rows(p: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(p)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{p}: not a readable Parquet file ({e})") from None
    n = 0
    for batch in pf.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            n += 1
            yield n, row


def _build(
    numbered: Iterator[tuple[int, Any]], cfg: DataConfig, tokenizer: Any, source: str, task: str, *, builtin: bool
) -> tuple[list[Question], LoadReport]:
    report = LoadReport(max_prompt_tokens=cfg.max_prompt_tokens)
    questions: list[Question] = []
    seen: set[str] = set()
    template = _chat_template(cfg)
    for n, row in numbered:
        report.total += 1
        try:
            q = _question(row, cfg, tokenizer, task, builtin, template)
            if q.id in seen:
                raise _RowError(f"duplicate id {q.id!r}")
        except _RowError as e:
            problem = f"{source} line {n}: {e}"
            if cfg.strict:
                raise DataError(f"{problem} (strict mode rejects the whole file; fix the row or set data.strict=false)")
            report.skipped += 1
            report.too_long += isinstance(e, _TooLong)
            if len(report.problems) < MAX_REPORTED_PROBLEMS:
                report.problems.append(problem)
            continue
        seen.add(q.id)
        questions.append(q)
    report.loaded = len(questions)
    if report.skipped > len(report.problems):
        report.problems.append(f"... and {report.skipped - len(report.problems)} more bad rows")
    return questions, report


class _RowError(ValueError):
    pass


class _TooLong(_RowError):
    pass


def _chat_template(cfg: DataConfig) -> str | None:
    """The chat template file's text (`data.chat_template_path`), None for the tokenizer's own."""
    if cfg.chat_template_path is None:
        return None
    try:
        return Path(cfg.chat_template_path).expanduser().read_text()
    except OSError as e:
        raise DataError(f"data.chat_template_path: cannot read {cfg.chat_template_path} ({e})") from None


def _question(row: Any, cfg: DataConfig, tokenizer: Any, task: str, builtin: bool,
              template: str | None = None) -> Question:
    if isinstance(row, _BadRow):
        raise _RowError(row.problem)
    if isinstance(row, list):
        raise _RowError("expected an object, got a JSON array (JSON Lines is one object per line, "
                        '{"question": ..., "answer": ...})')
    if not isinstance(row, dict):
        raise _RowError(f"expected an object, got {type(row).__name__}")
    qf, af, idf = ("question", "answer", "id") if builtin else (cfg.question_field, cfg.answer_field, cfg.id_field)
    question = _text_field(row, qf, cfg.max_question_chars, allow_numbers=False)
    answer = _text_field(row, af, cfg.max_question_chars, allow_numbers=True)
    qid = _id_field(row, idf) or content_id(question, answer)
    prompt, prompt_ids = encode_prompt(tokenizer, question, cfg.use_chat_template, system_prompt=cfg.system_prompt,
                                       template_kwargs=cfg.chat_template_kwargs, chat_template=template)
    if len(prompt_ids) > cfg.max_prompt_tokens:
        raise _TooLong(f"prompt has {len(prompt_ids)} tokens, above data.max_prompt_tokens={cfg.max_prompt_tokens}")
    return Question(id=qid, prompt=prompt, answer=answer, prompt_ids=prompt_ids, task=task)


def _text_field(row: dict, name: str, max_chars: int, *, allow_numbers: bool) -> str:
    if name not in row or row[name] is None:
        raise _RowError(f"missing field {name!r}")
    v = row[name]
    if allow_numbers and isinstance(v, (int, float)) and not isinstance(v, bool):
        if isinstance(v, float) and not math.isfinite(v):
            raise _RowError(f"field {name!r} is {v}")
        v = str(v)
    if not isinstance(v, str):
        raise _RowError(f"field {name!r} must be a string, got {type(v).__name__}")
    if not v.strip():
        raise _RowError(f"field {name!r} is empty")
    if len(v) > max_chars:
        raise _RowError(f"field {name!r} has {len(v)} characters, above data.max_question_chars={max_chars}")
    return v


def _id_field(row: dict, name: str | None) -> str | None:
    if name is None or row.get(name) is None:
        return None
    v = row[name]
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise _RowError(f"field {name!r} (id) must be a string or integer, got {type(v).__name__}")
    v = str(v)
    if not v.strip() or len(v) > 256:
        raise _RowError(f"field {name!r} (id) must be 1-256 characters")
    return v


def content_id(question: str, answer: str) -> str:
    """Stable id from the content: `q-` + 16 hex chars of blake2b(question NUL answer)."""
    h = hashlib.blake2b(f"{question}\x00{answer}".encode("utf-8", "surrogatepass"), digest_size=8)
    return "q-" + h.hexdigest()


def encode_prompt(tokenizer: Any, question: str, use_chat_template: bool, *, system_prompt: str | None = None,
                  template_kwargs: dict[str, Any] | None = None, chat_template: str | None = None) -> tuple[str, Any]:
    """(prompt text, int32 prompt ids) for a question; see the module docstring for BOS handling and the
    chat-template settings."""
    if use_chat_template:
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise DataError("data.use_chat_template is set but the tokenizer has no chat template; set it to false "
                            "or give one with data.chat_template_path")
        messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        messages.append({"role": "user", "content": question})
        try:
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                   chat_template=chat_template, **(template_kwargs or {}))
        except Exception as e:  # a Jinja error in the user's template: say which setting to fix
            raise DataError(f"the chat template failed to render ({type(e).__name__}: {e}); check "
                            "data.chat_template_path / data.chat_template_kwargs / data.system_prompt") from None
        return prompt, int32_array(tokenizer.encode(prompt, add_special_tokens=False))
    ids = tokenizer.encode(question, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos, *ids]
    return question, int32_array(ids)
