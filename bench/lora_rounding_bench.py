"""LoRA rounding bench (issue 44 item 4): what a bf16 generator serves of a young adapter, and what unmerged adapters
would cost, at a real projection (Qwen2.5-1.5B's q_proj: 1536 x 1536, weight std 0.02, bfloat16, rank 8).

    python bench/lora_rounding_bench.py [--tokens 1024] [--repeats 20] [--threads 1]

Per RMS of s B A (the issue's 8e-7 ... 8e-4; scaling 1, B A drawn at random and scaled):

- weight: the share of W's entries that bf16(W + s B A) leaves unchanged, and the relative error of the update it
  carries, |bf16(W + s B A) - W - s B A| / |s B A| (the issue's table);
- output: the share of the exact update U = X (s B A)^T found in y - bf16(X W^T) over `--tokens` random inputs
  (a projection on U) for the learner's `LoRALinear` in bf16 (FSDP2's param_dtype: x W^T rounded to bf16, then the
  low-rank term added and rounded), the merged bf16 generator (`actors.adapters.AdapterMerger`'s merge), unmerged
  adapters in a bf16 engine (W x + s B A x, the same operations as the learner's) and the learner in float32;
- |y_merged - y_learner| over the learner's own bf16 noise |y_learner - y_exact| (about 1.4: two bf16 roundings).

Cost of unmerged adapters (the option not built): bytes of A and B beside W per target and for all targets of the
1.5B model (rank 8, q/k/v/o/gate/up/down), and the time of one decode step of this projection for 1 and 32 rows,
x W^T vs x W^T + s (x A^T) B^T (bf16 on this CPU, median of `--repeats`, `--threads` torch threads).

`--network`: the same through a whole model, a random Qwen2 (`common.modeling.TinyQwen2`, h512 L4, vocab 512,
weights std 0.02, LoRA rank 8 on the default targets, every adapter at the RMS) over 8 x 128 random tokens: the
share of the float32 model's log-prob update U = log π - log π_base that the bf16 learner (`LoRALinear`) and the bf16
merged model carry beyond the bf16 base, and their mean |Δ log π| against the learner's own bf16 error.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.nn.functional import linear  # noqa: E402

OUT = IN = 1536
RANK = 8
QWEN_15B = dict(hidden=1536, kv=256, inter=8960, layers=28)  # Qwen2.5-1.5B's projection shapes


def adapter_bytes_15b(rank: int) -> tuple[int, int]:
    """(adapter bytes, target weight bytes) in bf16 for q/k/v/o/gate/up/down of every Qwen2.5-1.5B layer."""
    h, kv, f, n = QWEN_15B["hidden"], QWEN_15B["kv"], QWEN_15B["inter"], QWEN_15B["layers"]
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]  # (out, in)
    return (n * sum(rank * (o + i) for o, i in shapes) * 2, n * sum(o * i for o, i in shapes) * 2)


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--network", action="store_true", help="also the whole-model check (about a minute)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable timings on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from actors.adapters import AdapterMerger
    from learner.lora import LoRALinear

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(OUT, IN, generator=g) * 0.02).bfloat16()  # [out, in]
    x = torch.randn(args.tokens, IN, generator=g).bfloat16()  # [N, in]
    base = linear(x, w)  # [N, out]
    merger = AdapterMerger("-")
    merger.blocks, merger.base = {"blk": ["blk.proj.weight"]}, {"blk.proj.weight": w}  # the folder's read, skipped
    from common.messages import AdapterPublication

    spec = AdapterPublication(scaling=1.0, targets=["blk.proj"])
    print(f"{OUT} x {IN}, std 0.02, bf16, rank {RANK}, {args.tokens} tokens; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| RMS of s·B·A | entries unchanged | update error (weight) | share at the output: learner bf16 | merged bf16 "
          "| unmerged bf16 | learner fp32 | |merged − learner| / learner's bf16 noise |")
    print("|---|---|---|---|---|---|---|---|")
    for rms in (8e-7, 8e-6, 8e-5, 8e-4):
        a, b = torch.randn(RANK, IN, generator=g), torch.randn(OUT, RANK, generator=g)  # [r, in], [out, r]
        b *= rms / (b @ a).pow(2).mean().sqrt()
        a, b = a.bfloat16(), b.bfloat16()
        delta = b.double() @ a.double()  # [out, in]
        (bucket,) = merger._merged({"blk.proj.lora_A": a, "blk.proj.lora_B": b}, spec)
        merged = bucket["blk.proj.weight"]
        lora = LoRALinear(torch.nn.Linear(IN, OUT, bias=False), RANK, alpha=RANK)
        with torch.no_grad():
            lora.weight.data, lora.lora_A.data, lora.lora_B.data = w, a, b
            y_learner = lora(x)
            y_merged = linear(x, merged)
            y_unmerged = base + linear(linear(x, a), b)
            xf = x.float()
            y32, base32 = linear(xf, w.float()) + linear(linear(xf, a.float()), b.float()), linear(xf, w.float())
        u = x.double() @ delta.T
        exact = x.double() @ w.double().T + u

        def share(y, b0=base):
            return float(((y.double() - b0.double()) * u).sum() / (u * u).sum())

        noise = float((y_learner.double() - exact).norm())
        print(f"| {rms:.0e} | {float((merged == w).float().mean()):.1%} "
              f"| {float(((merged.double() - w.double()) - delta).norm() / delta.norm()):.2f} "
              f"| {share(y_learner):.3f} | {share(y_merged):.3f} | {share(y_unmerged):.3f} | {share(y32, base32):.3f} "
              f"| {float((y_merged.double() - y_learner.double()).norm()) / noise:.2f} |")

    ab, wb = RANK * (IN + OUT) * 2, IN * OUT * 2
    a15, w15 = adapter_bytes_15b(RANK)
    print(f"\nunmerged adapters' memory: {ab / 1e3:.1f} kB beside this weight's {wb / 1e6:.2f} MB (+{ab / wb:.2%}); "
          f"1.5B, all 7 targets: {a15 / 1e6:.1f} MB beside {w15 / 1e9:.2f} GB (+{a15 / w15:.2%})")
    a, b = torch.randn(RANK, IN).bfloat16(), torch.randn(OUT, RANK).bfloat16()
    print("| rows | x W^T ms | x W^T + s (x A^T) B^T ms | slower |\n|---|---|---|---|")
    with torch.inference_mode():
        for rows in (1, 32):
            xr = torch.randn(rows, IN).bfloat16()
            t_m = timed(lambda: linear(xr, w), args.repeats)
            t_u = timed(lambda: linear(xr, w) + linear(linear(xr, a), b), args.repeats)
            print(f"| {rows} | {t_m * 1e3:.3f} | {t_u * 1e3:.3f} | {t_u / t_m - 1:+.0%} |")
    if args.network:
        network_check()


def network_check() -> None:
    import copy

    from common.config import LoRAConfig
    from common.modeling import TinyQwen2
    from learner.lora import adapters_disabled, apply_lora, lora_modules

    model = TinyQwen2(vocab_size=512, hidden_size=512, num_layers=4, num_heads=4, num_kv_heads=2, seed=1,
                      max_positions=256, bos_token_id=1, eos_token_id=2, pad_token_id=0).build()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    base16 = copy.deepcopy(model).bfloat16().eval()
    apply_lora(model, LoRAConfig(rank=RANK, alpha=RANK))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 512, (8, 128), generator=g)  # [rows, T]

    def logp(m) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(m(input_ids=ids).logits.double(), -1)  # [rows, T, V]

    print("\nwhole model (random Qwen2 h512 L4, 8 x 128 tokens): share of the float32 log-prob update carried")
    print("| RMS of s·B·A | learner bf16 | merged bf16 | mean |merged − learner| | mean |learner bf16 − float32| "
          "| mean |U| |\n|---|---|---|---|---|---|")
    for rms in (1e-6, 1e-5, 1e-4, 1e-3):
        for mod in lora_modules(model).values():
            a, b = torch.randn(mod.lora_A.shape, generator=g), torch.randn(mod.lora_B.shape, generator=g)
            b *= rms / (b @ a).pow(2).mean().sqrt()
            mod.lora_A.data, mod.lora_B.data = a, b
        m32, l16, merged = copy.deepcopy(model).eval(), copy.deepcopy(model).bfloat16().eval(), copy.deepcopy(base16)
        merged.load_state_dict({f"{n}.weight": (m.weight.float() + m.lora_B.float() @ m.lora_A.float()).bfloat16()
                                for n, m in lora_modules(l16).items()}, strict=False)
        with adapters_disabled(m32):
            u = logp(m32)
        l32 = logp(m32)
        u = l32 - u
        with adapters_disabled(l16):
            b16 = logp(l16)
        ll, lm = logp(l16), logp(merged)

        def share(lp):
            return float(((lp - b16) * u).sum() / (u * u).sum())

        print(f"| {rms:.0e} | {share(ll):.3f} | {share(lm):.3f} | {float((lm - ll).abs().mean()):.1e} "
              f"| {float((ll - l32).abs().mean()):.1e} | {float(u.abs().mean()):.1e} |")


if __name__ == "__main__":
    main()
