"""common.tokenizer: the generic fast tokenizer is built without AutoTokenizer's imports, and is the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from common.tokenizer import auto_tokenizer, tokenizer_class_name

ROOT = Path(__file__).resolve().parents[2]


def test_the_fast_path_builds_what_auto_tokenizer_builds(tiny_model_dir):
    from transformers import AutoTokenizer

    assert tokenizer_class_name(tiny_model_dir) in ("TokenizersBackend", "PreTrainedTokenizerFast")
    ours, auto = auto_tokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(ours) is type(auto)
    text = "12+7*3=? <think>x</think> 33"
    assert ours(text).input_ids == auto(text).input_ids
    assert (ours.eos_token_id, ours.pad_token_id, ours.chat_template) == \
        (auto.eos_token_id, auto.pad_token_id, auto.chat_template)


def test_the_fast_path_does_not_import_the_model_registry(tiny_model_dir):
    """The point of it: a process that only needs a tokenizer skips transformers' generation utilities
    and scikit-learn (seconds of CPU per process)."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from common.tokenizer import auto_tokenizer\n"
            f"auto_tokenizer({str(tiny_model_dir)!r})\n"
            "print(sorted(m for m in ('sklearn', 'transformers.generation.utils', 'transformers.models.auto.modeling_auto')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_other_tokenizer_classes_and_broken_folders_go_through_auto_tokenizer(tiny_model_dir, tmp_path):
    import shutil

    import pytest

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"  # a model-specific class: only AutoTokenizer knows what to build
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert tokenizer_class_name(other) == "GPT2Tokenizer"
    assert type(auto_tokenizer(other)).__name__.startswith("GPT2Tokenizer")
    assert tokenizer_class_name(tmp_path / "missing") is None
    with pytest.raises(OSError):
        auto_tokenizer(tmp_path / "missing")
