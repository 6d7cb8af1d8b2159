"""Offline tokenizer and tiny Llama construction (no hub access anywhere).

`build_char_tokenizer()` makes a character-level fast tokenizer over printable ASCII with
`<pad>`, `<s>`, `</s>`, `<unk>`; `train_bpe_tokenizer(texts)` trains a byte-level BPE tokenizer
with a chat template on a corpus (the built-in chat model's); `TinyLlama(...).build()` (and `TinyQwen2`) makes a
randomly initialised Llama of any small size; `save_model_folder(...)` writes a normal Hugging Face folder
(config.json, model.safetensors, tokenizer files) that `transformers` and vLLM load. Tests build their models
with these; `common.toy_model` trains the built-in model on top of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
CHARS = [chr(c) for c in range(32, 127)]  # printable ASCII, one token each


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: every printable ASCII character is one token."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, padding_side="left"
    )
    fast.model_max_length = 4096
    return fast


USER, ASSISTANT = "<|user|>", "<|assistant|>"
THINK_TOKENS = ["<think>", "</think>"]
"""Whole tokens of the BPE tokenizer, but not special ones: decoding with `skip_special_tokens` (as vLLM
and the transformers engine do) keeps them, so the reward sees `</think>`."""

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{ bos_token }}<|user|>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>{{ message['content'] }}{{ eos_token }}"
    "{%- else -%}{{ raise_exception('this chat template has only user and assistant turns, got ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
"""System-free: `<s><|user|>question<|assistant|>` (+ the generation prompt `<|assistant|>`); an
assistant turn ends with `</s>`. A system turn is an error rather than silently dropped."""


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts`, with the chat template above.

    Digits are split one per token before the byte-level split (as in Llama 3 / Qwen-style
    tokenizers' digit handling), so numbers are never merged; merges form words and operator runs. Every
    byte is in the vocabulary, so any text encodes and decodes back unchanged."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    specials = SPECIALS + [USER, ASSISTANT]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator((_without_think_tokens(t) for t in texts), trainer=trainer)
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])  # training resets them
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, padding_side="left",
        additional_special_tokens=[USER, ASSISTANT],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    return fast


def _without_think_tokens(text: str) -> str:
    """No merges are spent on pieces of `<think>`/`</think>`, which are whole tokens anyway."""
    for t in THINK_TOKENS:
        text = text.replace(t, "\n")
    return text


@dataclass(frozen=True, kw_only=True)
class TinyLlama:
    """A randomly initialised Llama (float32) of the given size, deterministic in `seed`: `TinyLlama(vocab_size=V,
    hidden_size=64, ...).build()`."""

    vocab_size: int
    hidden_size: int = 96
    num_layers: int = 3
    num_heads: int = 4
    intermediate_size: int | None = None  # None: 3 x hidden_size
    max_positions: int = 512
    seed: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0

    def build(self) -> LlamaForCausalLM:
        cfg = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size or 3 * self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            max_position_embeddings=self.max_positions,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            tie_word_embeddings=False,
            torch_dtype="float32",
        )
        torch.manual_seed(self.seed)
        return LlamaForCausalLM(cfg)


QWEN2_VOCAB_ROWS = 151_936  # Qwen2 / Qwen2.5 embedding rows (the tokenizer has fewer tokens; the rest are padding)


@dataclass(frozen=True, kw_only=True)
class TinyQwen2:
    """A randomly initialised Qwen2 (float32) with Qwen2.5's architecture at tiny width: grouped-query
    attention (`num_kv_heads` < `num_heads`), RoPE base 1e6, tied input/output embeddings, a real vocabulary
    (151,936 rows) and long positions, so that the logits and lengths cost what they cost in a real run;
    deterministic in `seed`: `TinyQwen2(hidden_size=64, ...).build()`."""

    vocab_size: int = QWEN2_VOCAB_ROWS
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    intermediate_size: int | None = None  # None: 3 x hidden_size
    max_positions: int = 10_240
    rope_theta: float = 1_000_000.0
    seed: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0

    def build(self) -> Qwen2ForCausalLM:
        cfg = Qwen2Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size or 3 * self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_positions,
            rope_theta=self.rope_theta,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            tie_word_embeddings=True,
            use_sliding_window=False,
            torch_dtype="float32",
        )
        torch.manual_seed(self.seed)
        return Qwen2ForCausalLM(cfg)


def save_model_folder(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, path: str | Path) -> Path:
    """Write config, safetensors weights, tokenizer and generation config to `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_model_folder(path: str | Path, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 2,
                           seed: int = 0) -> Path:
    """An untrained tiny model folder for tests (char tokenizer + Llama).

    vLLM's CPU attention supports only some head sizes (32 works, 16 and 24 do not): keep
    hidden_size / num_heads = 32 or 64.
    """
    tok = build_char_tokenizer()
    model = TinyLlama(vocab_size=len(tok), hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                      seed=seed, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id).build()
    return save_model_folder(model, tok, path)
