"""Loading a model folder's tokenizer without paying for every model class.

    tok = auto_tokenizer(path)   # what AutoTokenizer.from_pretrained(path) returns

`from transformers import AutoTokenizer` imports the auto registries, which import the generation
utilities, torch._dynamo and scikit-learn: ~5 s of CPU in every process that only needs a tokenizer
(the driver, `exgrpo eval`, the in-run evaluator's question loading). When the folder's
`tokenizer_config.json` names the generic fast tokenizer (`TokenizersBackend`, called
`PreTrainedTokenizerFast` before transformers 5; the built-in models, and any folder written from a
`tokenizers` file), AutoTokenizer would build exactly that class, so it is built directly. Any other
class goes through AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def tokenizer_class_name(path: str | Path) -> str | None:
    """`tokenizer_class` of the folder's tokenizer_config.json (None when absent or unreadable)."""
    try:
        cfg = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = cfg.get("tokenizer_class") if isinstance(cfg, dict) else None
    return name if isinstance(name, str) else None


def auto_tokenizer(path: str | Path):
    """The tokenizer AutoTokenizer.from_pretrained(path) builds (errors as AutoTokenizer raises them)."""
    if tokenizer_class_name(path) in GENERIC_CLASSES and (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast  # the generic class (TokenizersBackend in transformers 5)

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
