#!/usr/bin/env python3
"""PyTorch's training step for tpx's block on a GPU: the time stage 01 is measured against.

The block of every stage (RMSNorm, q/k/v with grouped-query heads, rotary embedding on q and k,
causal attention, Wo and the residual, RMSNorm, SwiGLU and the residual; loss
0.5·mean((Y − T)²); one SGD step) written the way a PyTorch user would: fp32 master weights, the
forward under bf16 autocast, attention by scaled_dot_product_attention. It times the eager model
and the same model under torch.compile and prints one line each:

    torch eager: mean step 7.657 ms, 338.3 TFLOP/s (model FLOPs, H=4096 ...)

The FLOPs are the model's: a forward's seven projections (2·S·B per weight element) plus causal
attention's two products (2·B·NH·S²·D with the mask's half), and a step three forwards' worth.

    python3 tools/torch_block_perf.py [--hidden 4096 --heads 32 --kv-heads NKV --ffn 11008
                                       --seq 2048 --batch 1 --layers 1 --steps 10]

Without PyTorch or without a GPU it prints one line saying so and exits 2.
"""
import argparse
import sys
import time


def model_flops(h, nh, nkv, f, s, b, layers):
    """Forward + backward FLOPs of `layers` blocks: three times the forward's products."""
    d = h // nh
    projections = 2 * s * b * (2 * h * h + 2 * h * nkv * d + 3 * h * f)
    attention = 2 * b * nh * s * s * d  # QKᵀ and PV, 2·S²·D each per head, halved by causality
    return 3 * layers * (projections + attention)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=0, help="default: --heads")
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    a = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("torch_block_perf: PyTorch is not installed here; nothing to time")
        return 2
    if not torch.cuda.is_available():
        print("torch_block_perf: PyTorch sees no GPU (torch.cuda.is_available() is False)")
        return 2

    h, nh, f, s, b, layers = a.hidden, a.heads, a.ffn, a.seq, a.batch, a.layers
    nkv = a.kv_heads or nh
    d = h // nh
    dev = torch.device("cuda")
    torch.manual_seed(0)

    # Rotate-half RoPE (Llama's): pair (i, i + D/2) turned by position · θ^(−2i/D).
    inv_freq = a.rope_theta ** (-torch.arange(0, d // 2, device=dev, dtype=torch.float64) * 2 / d)
    angle = torch.arange(s, device=dev, dtype=torch.float64)[:, None] * inv_freq[None]
    cos = torch.cos(angle).repeat(1, 2).float()
    sin = torch.sin(angle).repeat(1, 2).float()

    def rope(t):
        half = d // 2
        rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * cos.to(t.dtype) + rotated * sin.to(t.dtype)

    def rmsnorm(x, g):
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        return x * scale.to(x.dtype) * g

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()

            def weight(rows, cols):  # [in, out], as tpx stores them: y = x · W
                return torch.nn.Parameter(torch.randn(rows, cols, device=dev) * 0.02)

            self.g1 = torch.nn.Parameter(torch.ones(h, device=dev))
            self.g2 = torch.nn.Parameter(torch.ones(h, device=dev))
            self.wq, self.wo = weight(h, h), weight(h, h)
            self.wk, self.wv = weight(h, nkv * d), weight(h, nkv * d)
            self.w_gate, self.w_up, self.w_down = weight(h, f), weight(h, f), weight(f, h)

        def forward(self, x):  # x: [B, S, H] (PyTorch's usual layout; tpx's is [S, B, H])
            hn = rmsnorm(x, self.g1)
            q = (hn @ self.wq).view(b, s, nh, d).transpose(1, 2)
            k = (hn @ self.wk).view(b, s, nkv, d).transpose(1, 2)
            v = (hn @ self.wv).view(b, s, nkv, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True,
                                               enable_gqa=nkv != nh)
            x = x + o.transpose(1, 2).reshape(b, s, h) @ self.wo
            hn = rmsnorm(x, self.g2)
            return x + (F.silu(hn @ self.w_gate) * (hn @ self.w_up)) @ self.w_down

    model = torch.nn.Sequential(*[Block() for _ in range(layers)])
    x = torch.randn(b, s, h, device=dev)
    target = torch.randn(b, s, h, device=dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(m):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(x)
        loss = 0.5 * ((y.float() - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    flops = model_flops(h, nh, nkv, f, s, b, layers)
    for name, m in (("eager", model), ("compile", torch.compile(model))):
        for _ in range(3):  # warm-up: kernel choice, the allocator, compilation
            step(m)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step(m)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / a.steps * 1e3
        print(f"torch {name}: mean step {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s (model FLOPs, "
              f"H={h} NH={nh} NKV={nkv} F={f} S={s} B={b} L={layers}, bf16 autocast, SGD)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
