#!/usr/bin/env python3
"""PyTorch's fused attention at bench_attention's GPU shapes, for comparison.

Times torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), forward +
backward (and, at S 2048 and 8192 with D 128, the forward and the backward apart: rows sdpa-fwd,
sdpa-bwd), in bf16 on cuda at B 1, NH 32, D 128 and S = 1024, 2048, 8192, 16384 (the shapes of
build/bin/bench_attention's cuda rows; --head-dim 64 --seq 2048 its D = 64 row), and prints one line per shape with its TFLOP/s under
the same FLOP convention (FlashAttention-2's, arXiv:2307.08691 section 4.1): the causal forward
counts 4·B·NH·S²·D / 2, the backward 2.5 times that, a step 3.5 times.

    python3 tools/sdpa_bench.py [--seq 1024 2048 8192 16384] [--head-dim 128] [--iters 20]

Without PyTorch or without a GPU it prints one line saying so and exits 2.
"""
import argparse
import sys


def causal_step_flops(b, nh, s, d):
    forward = 4.0 * b * nh * s * s * d / 2.0
    return forward * 3.5


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 8192, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()

    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("sdpa_bench: PyTorch is not installed here; nothing to time")
        return 2
    if not torch.cuda.is_available():
        print("sdpa_bench: PyTorch sees no GPU (torch.cuda.is_available() is False); nothing to time")
        return 2

    device = torch.device("cuda")
    print(f"sdpa_bench: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, bf16, "
          f"fwd+bwd, causal FLOPs = 3.5 * 4*B*NH*S^2*D/2")
    b, nh, d = args.batch, args.heads, args.head_dim
    for s in args.seq:
        gen = torch.Generator(device=device).manual_seed(1)
        shape = (b, nh, s, d)  # SDPA's layout: [B, NH, S, D]
        q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
                   .requires_grad_() for _ in range(3))
        dout = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(dout)
            q.grad = k.grad = v.grad = None

        for _ in range(3):  # warm-up: kernel selection, allocator
            step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            step()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / args.iters
        tflops = causal_step_flops(b, nh, s, d) / (ms * 1e-3) / 1e12
        head_dim = "" if d == 128 else f"/D:{d}"  # as bench_attention names its rows
        print(f"attention/cuda/bf16/sdpa/S:{s}{head_dim}  B={b} NH={nh} D={d}  {ms:.3f} ms  "
              f"TFLOP/s={tflops:.1f}")
        if d == 128 and s in (2048, 8192):  # the forward and the backward apart, as bench_attention
            for name, ms in split_passes(F, q, k, v, dout, args.iters):
                share = 1.0 if name == "fwd" else 2.5
                tflops = causal_step_flops(b, nh, s, d) / 3.5 * share / (ms * 1e-3) / 1e12
                print(f"attention/cuda/bf16/sdpa-{name}/S:{s}  B={b} NH={nh} D={d}  {ms:.3f} ms  "
                      f"TFLOP/s={tflops:.1f}")
    return 0


def split_passes(F, q, k, v, dout, iters):
    """[("fwd", ms), ("bwd", ms)]: SDPA's forward alone, then its backward alone (each
    backward from a forward run before its timer starts)."""
    import torch
    timer = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    with torch.no_grad():
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        timer[0].record()
        for _ in range(iters):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        timer[1].record()
    torch.cuda.synchronize()
    fwd = timer[0].elapsed_time(timer[1]) / iters
    bwd = 0.0
    for i in range(iters + 3):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
        timer[0].record()
        out.backward(dout)
        timer[1].record()
        torch.cuda.synchronize()
        q.grad = k.grad = v.grad = None
        if i >= 3:  # after the warm-up
            bwd += timer[0].elapsed_time(timer[1])
    return [("fwd", fwd), ("bwd", bwd / iters)]


if __name__ == "__main__":
    sys.exit(main())
