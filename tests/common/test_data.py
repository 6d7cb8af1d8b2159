"""Dataset loading: JSONL and Parquet, configurable fields, stable ids, bad rows, strict mode."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.config import DataConfig
from common.data import DataError, content_id, load_questions
from common.modeling import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _write_jsonl(path, lines: list) -> str:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


GOOD = [{"q": "1+1=", "a": "2", "key": "first"}, {"q": "2+2=", "a": 4}]
BAD_ROWS = [
    ({"a": "2"}, "missing field 'q'"),
    ({"q": 5, "a": "2"}, "field 'q' must be a string, got int"),
    ({"q": "  ", "a": "2"}, "field 'q' is empty"),
    ({"q": "x" * 101, "a": "2"}, "field 'q' has 101 characters, above data.max_question_chars=100"),
    ({"q": "1+1=", "a": ["2"]}, "field 'a' must be a string, got list"),
    ({"q": "1+1=", "a": True}, "field 'a' must be a string, got bool"),
    ({"q": "1+1=", "a": "2", "key": 1.5}, "field 'key' (id) must be a string or integer, got float"),
    ({"q": "y" * 60, "a": "2"}, "prompt has 61 tokens, above data.max_prompt_tokens=50"),
    ({"q": "3+3=", "a": "6", "key": "first"}, "duplicate id 'first'"),
    ("[1, 2]", "expected an object, got a JSON array (JSON Lines is one object per line"),
    ("{not json", "not valid JSON"),
]


def _cfg(path, **kw) -> DataConfig:
    return DataConfig(train_path=path, question_field="q", answer_field="a", id_field="key", max_question_chars=100,
                      max_prompt_tokens=50, **kw)


def test_jsonl_good_rows_load_with_bos_int32_ids_and_stable_ids(tmp_path, tok):
    path = _write_jsonl(tmp_path / "d.jsonl", GOOD)
    qs, rep = load_questions(_cfg(path), tok, "train")
    assert (rep.total, rep.loaded, rep.skipped, rep.problems) == (2, 2, 0, [])
    assert qs[0].id == "first" and qs[0].prompt == "1+1=" and qs[0].answer == "2" and qs[0].task == "d"
    assert qs[1].id == content_id("2+2=", "4") and qs[1].answer == "4"
    assert qs[1].id.startswith("q-") and len(qs[1].id) == 18
    assert qs[0].prompt_ids.dtype == np.int32
    assert qs[0].prompt_ids.tolist() == [tok.bos_token_id] + tok.encode("1+1=", add_special_tokens=False)
    again, _ = load_questions(_cfg(path), tok, "train")
    assert [q.id for q in again] == [q.id for q in qs]


def test_content_id_is_a_fixed_function_of_the_text():
    assert content_id("2+2=", "4") == content_id("2+2=", "4") != content_id("2+2=", "5")
    assert content_id("2+2=", "4") == "q-" + __import__("hashlib").blake2b(b"2+2=\x004", digest_size=8).hexdigest()


def test_jsonl_bad_rows_are_skipped_and_reported_with_line_numbers(tmp_path, tok):
    lines = GOOD + [row for row, _ in BAD_ROWS]
    path = _write_jsonl(tmp_path / "d.jsonl", lines[:2] + [""] + lines[2:])  # a blank line is not a row
    qs, rep = load_questions(_cfg(path), tok, "train")
    assert len(qs) == 2 and rep.loaded == 2 and rep.skipped == len(BAD_ROWS) and rep.total == 2 + len(BAD_ROWS)
    for i, (_, problem) in enumerate(BAD_ROWS):
        assert rep.problems[i].startswith(f"d.jsonl line {i + 4}: "), rep.problems[i]
        assert problem in rep.problems[i]


def test_strict_mode_rejects_the_whole_file(tmp_path, tok):
    path = _write_jsonl(tmp_path / "d.jsonl", GOOD + [{"q": 5, "a": "2"}])
    with pytest.raises(DataError, match=r"d.jsonl line 3: field 'q' must be a string.*strict mode"):
        load_questions(_cfg(path, strict=True), tok, "train")
    ok = _write_jsonl(tmp_path / "ok.jsonl", GOOD)
    assert len(load_questions(_cfg(ok, strict=True), tok, "train")[0]) == 2


def test_parquet_bad_rows(tmp_path, tok):
    table = pa.table({"q": ["1+1=", None, "", "x" * 200, "5+5="], "a": ["2", "3", "4", "5", None],
                      "key": [None, None, None, None, "e"]})
    path = tmp_path / "d.parquet"
    pq.write_table(table, path)
    qs, rep = load_questions(_cfg(str(path)), tok, "train")
    assert [q.prompt for q in qs] == ["1+1="] and rep.skipped == 4
    assert rep.problems == [
        "d.parquet line 2: missing field 'q'",
        "d.parquet line 3: field 'q' is empty",
        "d.parquet line 4: field 'q' has 200 characters, above data.max_question_chars=100",
        "d.parquet line 5: missing field 'a'",
    ]
    with pytest.raises(DataError, match="d.parquet line 2: missing field 'q'"):
        load_questions(_cfg(str(path), strict=True), tok, "train")


def test_parquet_with_wrong_column_names_skips_every_row(tmp_path, tok):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["1+1="], "answer": ["2"]}), path)
    qs, rep = load_questions(_cfg(str(path)), tok, "train")
    assert qs == [] and rep.problems == ["d.parquet line 1: missing field 'q'"]
    qs, _ = load_questions(DataConfig(train_path=str(path)), tok, "train")  # default field names
    assert [q.answer for q in qs] == ["2"]


def test_unreadable_files_raise_data_error(tmp_path, tok):
    with pytest.raises(DataError, match="dataset file not found"):
        load_questions(DataConfig(train_path=str(tmp_path / "none.jsonl")), tok, "train")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown dataset format '.csv'; use .jsonl or .parquet"):
        load_questions(DataConfig(train_path=str(tmp_path / "d.csv")), tok, "train")
    (tmp_path / "d.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_questions(DataConfig(train_path=str(tmp_path / "d.parquet")), tok, "train")


def test_many_bad_rows_are_counted_but_reporting_is_capped(tmp_path, tok):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"q": 1, "a": "2"}] * 500)
    _, rep = load_questions(_cfg(path), tok, "train")
    assert rep.skipped == 500 and len(rep.problems) == 51 and rep.problems[-1] == "... and 450 more bad rows"


def test_test_split_of_a_file_config(tmp_path, tok):
    train = _write_jsonl(tmp_path / "train.jsonl", GOOD)
    qs, rep = load_questions(_cfg(train), tok, "test")
    assert qs == [] and rep.problems == ["no test split: data.test_path is not set"]
    cfg = _cfg(train).model_copy(update={"test_path": _write_jsonl(tmp_path / "test.jsonl", GOOD[1:])})
    assert [q.prompt for q in load_questions(cfg, tok, "test")[0]] == ["2+2="]


def test_builtin_tasks_go_through_the_same_loader(tok):
    cfg = DataConfig(task="countdown", num_train=100, num_test=20, seed=1)
    train, rep = load_questions(cfg, tok, "train")
    test, _ = load_questions(cfg, tok, "test")
    assert len(train) == 100 and len(test) == 20 and rep.skipped == 0
    assert train[0].task == "countdown" and train[0].prompt_ids[0] == tok.bos_token_id
    assert not {q.id for q in train} & {q.id for q in test}
    short = cfg.model_copy(update={"max_prompt_tokens": 5})
    _, rep = load_questions(short, tok, "train")
    assert rep.skipped == 100 and "above data.max_prompt_tokens=5" in rep.problems[0]
    assert rep.too_long == 100 and "(100 of them with a prompt over data.max_prompt_tokens=5)" in rep.summary()


def test_chat_template(tmp_path, tok):
    path = _write_jsonl(tmp_path / "d.jsonl", GOOD)
    with pytest.raises(DataError, match="tokenizer has no chat template; set it to false"):
        load_questions(_cfg(path, use_chat_template=True), tok, "train")
    tok2 = build_char_tokenizer()
    tok2.chat_template = "{{ bos_token }}{% for m in messages %}U:{{ m['content'] }}{% endfor %}A:"
    qs, _ = load_questions(_cfg(path, use_chat_template=True), tok2, "train")
    assert qs[0].prompt == "<s>U:1+1=A:"
    assert qs[0].prompt_ids.tolist() == [tok2.bos_token_id] + tok2.encode("U:1+1=A:", add_special_tokens=False)


def test_system_prompt_template_kwargs_and_a_template_file(tmp_path, tok):
    """The system message, extra template variables (as Qwen3's enable_thinking) and a template file that
    replaces the tokenizer's, each reaching the rendered prompt; each refused without the chat template."""
    path = _write_jsonl(tmp_path / "d.jsonl", GOOD)
    tok2 = build_char_tokenizer()
    tok2.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
                          "{% if enable_thinking is defined and not enable_thinking %}N{% endif %}A:")
    cfg = _cfg(path, use_chat_template=True, system_prompt="Be brief.", chat_template_kwargs={"enable_thinking": False})
    qs, _ = load_questions(cfg, tok2, "train")
    assert qs[0].prompt == "s:Be brief.;u:1+1=;NA:"
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}=")
    qs, _ = load_questions(_cfg(path, use_chat_template=True, chat_template_path=str(template)), tok, "train")
    assert qs[0].prompt == "<1+1=>="  # the char tokenizer has no template of its own: the file is used
    for kw in ({"system_prompt": "x"}, {"chat_template_kwargs": {"a": 1}}, {"chat_template_path": str(template)}):
        with pytest.raises(ValueError, match="only apply to the chat template; set data.use_chat_template=true"):
            _cfg(path, **kw)
    with pytest.raises(ValueError, match="data.chat_template_path: .*nope.jinja is not a file"):
        _cfg(path, use_chat_template=True, chat_template_path=str(tmp_path / "nope.jinja"))
    template.write_text("{% for m in messages %}{{ m.content | nofilter }}{% endfor %}")
    with pytest.raises(DataError, match="the chat template failed to render .*check data.chat_template_path"):
        load_questions(_cfg(path, use_chat_template=True, chat_template_path=str(template)), tok, "train")


# ------------------------------------------------------------------ files that are not JSON Lines (issue 51)


def test_a_json_array_file_is_named_as_such_with_the_conversion(tmp_path, tok):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(GOOD, indent=2))  # what json.dump(rows, f, indent=2) writes
    with pytest.raises(DataError, match=r"d.json: a JSON array of 2 items, not JSON Lines; JSON Lines is one object "
                                        r"per line; convert it with python -c .* > d.jsonl"):
        load_questions(_cfg(str(path)), tok, "train")
    path.write_text(json.dumps(GOOD[0], indent=2))
    with pytest.raises(DataError, match=r"one JSON object spread over several lines, not JSON Lines"):
        load_questions(_cfg(str(path)), tok, "train")


def test_a_latin1_file_is_named_not_utf8(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps({"q": "café=", "a": "1"}, ensure_ascii=False).encode("latin-1") + b"\n"
                     + json.dumps(GOOD[0]).encode() + b"\n")
    qs, rep = load_questions(_cfg(str(path)), tok, "train")
    assert len(qs) == 1 and rep.problems == ["d.jsonl line 1: not UTF-8 text (byte 0xe9 at column 11): the file has "
                                             "another encoding (latin-1?); re-save it as UTF-8"]
