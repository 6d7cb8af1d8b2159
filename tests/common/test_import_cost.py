"""common.import_cost: a process that loads a model imports no scikit-learn (2.6 s of each learner rank's,
generator's and driver's start here), and transformers still builds and generates."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = """
import sys
{hook}
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
{late}
cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, pad_token_id=0)
model = AutoModelForCausalLM.from_config(cfg)
out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False, min_new_tokens=3)
finders = sum(type(f).__name__ == "_PatchOnLoad" for f in sys.meta_path)
print(out.shape[1], "sklearn" in sys.modules, finders)
"""
HOOK = "from common.import_cost import skip_sklearn_in_transformers as skip; skip(); skip()"


def _run(hook: str = "", late: str = "") -> str:
    return subprocess.run([sys.executable, "-c", CODE.format(hook=hook, late=late)], cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=300).stdout.strip()


def test_a_process_that_loads_a_model_imports_no_sklearn_and_still_generates():
    # installed before transformers (a worker's setup hook, the CLI's main): one finder, however often it is called
    assert _run(hook=HOOK) == "6 False 1"
    # called once transformers is loaded: too late for scikit-learn, which came with the model classes; no finder
    assert _run(late=HOOK) == f"6 {importlib.util.find_spec('sklearn') is not None} 0"
    if importlib.util.find_spec("sklearn") is not None:  # MLflow installs it: what the hook saves
        assert _run() == "6 True 0"
