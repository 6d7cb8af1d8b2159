"""Checks shared by the two engine test modules: teacher-forced log-probs of a plain HF model."""

from __future__ import annotations

import numpy as np
import torch


def perturbed_state_dict(model: torch.nn.Module, seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded noise: a "new policy version" with Hugging Face names. Tied entries (a head
    that is the embedding) stay one tensor under both names, as a real learner's version is."""
    g = torch.Generator().manual_seed(seed)
    out, seen = {}, {}
    for k, v in model.state_dict().items():
        if (v.data_ptr(), v.shape) not in seen:
            noise = torch.randn(v.shape, generator=g, dtype=v.dtype) * scale * (v.float().std() if v.numel() > 1 else 1)
            seen[v.data_ptr(), v.shape] = (v + noise).contiguous()
        out[k] = seen[v.data_ptr(), v.shape]
    return out


@torch.inference_mode()
def teacher_forced(model: torch.nn.Module, prompt: np.ndarray, response: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log-probs [T], entropies [T]) of `response` after `prompt` at temperature 1, full vocabulary."""
    ids = torch.as_tensor(np.concatenate([prompt, response]).astype(np.int64))[None]  # [1, P+T]
    logits = model(input_ids=ids).logits[0].float()  # [P+T, V]
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # [T, V]
    tok = torch.as_tensor(response.astype(np.int64))
    lp = logp.gather(1, tok[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return lp.numpy(), ent.numpy()


def prompt_ids(tok, text: str) -> np.ndarray:
    return np.asarray([tok.bos_token_id, *tok.encode(text)], dtype=np.int32)


def check_stop_strings_and_eos(engine, tok) -> None:
    """64 samples with vowels as stop strings: text cut before the first stop, nothing after EOS, both kinds seen."""
    from actors.engines import Sampling

    stops = ("a", "e", "i", "o", "u")
    old = engine.sampling
    engine.sampling = Sampling(temperature=1.0, max_new_tokens=24, stop=stops)
    try:
        outs = engine.generate([prompt_ids(tok, "q: "), prompt_ids(tok, "r: ")], [32, 32], seed=3)
    finally:
        engine.sampling = old
    check_stops(outs, tok, stops, max_new_tokens=24)


def check_stops(outs, tok, stops, max_new_tokens):
    by_string = by_eos = 0
    for s in (s for o in outs for s in o):
        full = tok.decode(s.token_ids.tolist(), skip_special_tokens=True)
        assert not any(x in s.text for x in stops), "the returned text is cut before the stop string"
        body = s.token_ids[:-1].tolist()
        assert tok.eos_token_id not in body, "nothing is generated after EOS"
        if s.finish_reason == "length":
            assert len(s.token_ids) == max_new_tokens and not any(x in full for x in stops)
        elif s.token_ids[-1] == tok.eos_token_id:
            by_eos += 1
        else:
            by_string += 1
            assert any(x in full for x in stops)
            prefix = tok.decode(body, skip_special_tokens=True)
            assert not any(x in prefix for x in stops), "generation stops at the first stop string"
    assert by_string > 0 and by_eos > 0, f"expected both stop kinds in 64 samples: {by_string=} {by_eos=}"


def check_rollout_logprobs(refs: dict, prompt: np.ndarray, rollout, atol: float = 1e-4) -> None:
    """A rollout's behaviour log-probs equal teacher-forced ones of the version that sampled each token: all of
    `refs[version]` (a model per version), or, for a partial rollout (newest_version > version), a prefix under the
    oldest version and the rest under the newest."""
    old = teacher_forced(refs[rollout.version], prompt, rollout.response_ids)[0]
    if rollout.newest_version == rollout.version:
        np.testing.assert_allclose(rollout.logprobs, old, atol=atol)
        return
    err_old = np.abs(rollout.logprobs - old)
    err_new = np.abs(rollout.logprobs - teacher_forced(refs[rollout.newest_version], prompt, rollout.response_ids)[0])
    cut = int(np.argmax(err_old > atol)) if (err_old > atol).any() else len(err_old)
    assert 0 < cut, "a partial rollout's first token comes from its oldest version"
    assert err_old[:cut].max() < atol and (cut == len(err_new) or err_new[cut:].max() < atol), (err_old, err_new)
