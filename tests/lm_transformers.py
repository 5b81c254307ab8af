#!/usr/bin/env python3
"""Stage 01's language model against Hugging Face transformers' LlamaForCausalLM, same weights.

Runs 01_baseline --task lm for one step with --dump, builds a LlamaForCausalLM with the same
config (GQA, RoPE theta, RMSNorm eps 1e-5, no biases, untied output layer, eager attention), loads
the dumped initial weights into it (an nn.Linear holds W^T of our [in, out] weights), and runs it in
float64 on the CPU on the dumped tokens (transformers' own code rounds a few steps to fp32: see
TOLERANCE). The loss is computed here from the logits against the dumped targets: position s
predicts the stream's token s + 1, also at the last position, which transformers' own `labels`
shift would drop. Then the loss and every gradient (each layer's nine parameters, the embedding,
the final norm, the output layer) are compared, one table row each.

    lm_transformers.py --bin build/bin/01_baseline --work DIR [--mpirun "mpiexec FLAGS"]
                       [--python .venv-hf/bin/python]
                       [--vocab V --hidden H --heads NH --kv-heads NKV --ffn F --seq S
                        --batch B --layers L --rope-theta THETA] [--self-test]

--self-test also shows that the comparison can fail: after the comparison passes, it repeats it
with one weight element changed before transformers runs, with one element of one of our gradients
off by 0.1 % of that gradient's largest value, and with transformers at another RoPE theta, and
it passes only if every one of those is caught.

Exit status: 0 pass, 1 mismatch (or a self-test perturbation not caught), 2 bad input or a failed
run of the stage, 77 (a skip for ctest) where numpy, torch or transformers cannot be imported.
With --python, the script runs itself under that interpreter (the virtual environment that
scripts/setup.sh makes, on Debian's python3-torch) when it exists.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys

np = None  # numpy, imported in main() beside torch: a missing one is a skip as well

SKIP = 77

# Our fp32 program against transformers in float64. transformers itself rounds to fp32 in places
# (LlamaRMSNorm's variance, the attention softmax, RoPE's cos/sin, LlamaForCausalLM's logits), so
# both sides carry fp32 rounding (2^-24 ≈ 6e-8 relative per operation) summed over a few dozen
# operations in a chain: under 1e-6 of a tensor's largest value at these sizes. 1e-5, DESIGN.md's
# fp32 tolerance, leaves room for that and catches a single element off by 1e-3 of the tensor's
# largest value (the self-test).
TOLERANCE = 1e-5
EPS = 1e-5  # DESIGN.md: RMSNorm(v; g) = v / sqrt(mean(v²) + 1e-5) · g
# Our tensor names -> transformers' (and whether stored transposed): tools/tpx_hf.py's, which
# exports and imports checkpoints with the same mapping.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
from tpx_hf import hf_names  # noqa: E402

from under_python import rerun_under


def fail(message):
    print(f"lm_transformers: error: {message}", file=sys.stderr)
    sys.exit(2)


def run_stage(a, dump, extra=(), ranks=1):
    """The stage's one step of the language model with --dump (on `ranks` ranks, with `extra`
    flags: tests/moe_transformers.py's experts)."""
    if os.path.exists(dump):
        shutil.rmtree(dump)
    os.makedirs(os.path.dirname(dump) or ".", exist_ok=True)
    cmd = shlex.split(a.mpirun) + ["-np", str(ranks)] if a.mpirun else []
    cmd += [a.bin, "--task", "lm", "--data", "synthetic", "--vocab", str(a.vocab),
            "--hidden", str(a.hidden), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads),
            "--ffn", str(a.ffn), "--seq", str(a.seq), "--batch", str(a.batch),
            "--layers", str(a.layers), "--rope-theta", repr(a.rope_theta), "--seed", str(a.seed),
            *extra, "--steps", "1", "--dump", dump]
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print(r.stdout)
        fail(f"{os.path.basename(a.bin)} exited {r.returncode}")


def load_dump(a, dump):
    """The dump's tokens, targets, loss, weights and gradients (float64), checked against the
    sizes asked for."""
    cfg = json.load(open(os.path.join(dump, "config.json")))
    want = {"task": "lm", "vocab": a.vocab, "hidden": a.hidden, "heads": a.heads,
            "kv_heads": a.kv_heads, "ffn": a.ffn, "seq": a.seq, "batch": a.batch,
            "layers": a.layers, "rope_theta": a.rope_theta, "eps": EPS}
    for k, v in want.items():
        if cfg.get(k) != v:
            fail(f"{dump}/config.json: {k} is {cfg.get(k)!r}, the run asked for {v!r}")

    def npy(name, dtype, shape):
        x = np.load(os.path.join(dump, name + ".npy"))
        if x.dtype != dtype or x.shape != shape:
            fail(f"{dump}/{name}.npy: {x.dtype} {x.shape}, expected {np.dtype(dtype)} {shape}")
        return x

    tokens = npy("tokens", np.int32, (a.seq, a.batch))
    targets = npy("targets", np.int32, (a.seq, a.batch))
    loss = float(npy("loss", np.float32, (1,))[0])
    weights, grads = {}, {}
    for name in hf_names(a.layers):
        w = np.load(os.path.join(dump, name + ".npy"))
        g = npy(name + ".grad", np.float32, w.shape)
        weights[name], grads[name] = w.astype(np.float64), g.astype(np.float64)
    return tokens, targets, loss, weights, grads


def transformers_lm(a, tokens, targets, weights, rope_theta):
    """LlamaForCausalLM in float64 with our weights: the loss and every gradient, in our layout."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        hidden_act="silu", max_position_embeddings=a.seq, rms_norm_eps=EPS, rope_theta=rope_theta,
        rope_scaling=None, attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        attention_dropout=0.0, use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double()
    if model.config._attn_implementation != "eager":
        fail(f"transformers chose {model.config._attn_implementation} attention, not eager")
    params = dict(model.named_parameters())
    names = hf_names(a.layers)
    if set(params) != {hf for hf, _ in names.values()}:
        fail(f"LlamaForCausalLM's parameters are not the ones mapped here: {sorted(params)}")
    return loss_and_grads(model, names, weights, tokens, targets)


def loss_and_grads(model, names, weights, tokens, targets):
    """`model` (float64) with our weights (`names`: ours -> transformers', transposed) on our
    tokens: the mean cross-entropy against our targets and every gradient, in our layout."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, (hf, transposed) in names.items():
            w = torch.from_numpy(weights[name].T if transposed else weights[name])
            if params[hf].shape != w.shape:
                fail(f"{name}: transformers' {hf} is {tuple(params[hf].shape)}, ours gives "
                     f"{tuple(w.shape)}")
            params[hf].copy_(w)
    model.train()  # no dropout in this config either way; gradients on

    ids = torch.from_numpy(tokens.T.astype(np.int64))  # [B, S]: transformers is batch first
    tgt = torch.from_numpy(targets.T.astype(np.int64))
    logits = model(input_ids=ids).logits.double()  # [B, S, V]
    target_logit = logits.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    loss = (torch.logsumexp(logits, dim=-1) - target_logit).mean()
    model.zero_grad()
    loss.backward()
    grads = {}
    for name, (hf, transposed) in names.items():
        g = params[hf].grad.detach().numpy()
        grads[name] = g.T if transposed else g
    return float(loss), grads


def compare(our_loss, our_grads, hf_loss, hf_grads, quiet=False):
    """One row per tensor; True when every one is within TOLERANCE of its largest value."""
    rows = [("loss", "[1]", abs(hf_loss), abs(our_loss - hf_loss))]
    for name, ref in hf_grads.items():
        ours = our_grads[name]
        shape = "[" + ", ".join(map(str, ref.shape)) + "]"
        rows.append((name + ".grad", shape, float(np.abs(ref).max()),
                     float(np.abs(ours - ref).max())))
    ok = True
    if not quiet:
        print(f"{'tensor':<22} {'shape':<10} {'max |transformers|':>18} {'max |diff|':>11} "
              f"{'diff/max':>9}  (tolerance {TOLERANCE:g} of max)")
    for name, shape, scale, diff in rows:
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
        good = scale > 0 and rel <= TOLERANCE  # an all-zero reference gradient proves nothing
        ok &= good
        if not quiet or not good:
            print(f"{name:<22} {shape:<10} {scale:18.6e} {diff:11.3e} {rel:9.2e}  "
                  f"{'ok' if good else 'MISMATCH'}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, help="the 01_baseline executable")
    ap.add_argument("--work", required=True, help="a directory for the dump (replaced)")
    ap.add_argument("--mpirun", default="", help="launcher and its flags; -np 1 is added")
    ap.add_argument("--vocab", type=int, default=101)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--python", help="run under this interpreter when it exists")
    a = ap.parse_args()
    rerun_under(a.python, __file__)

    global np
    try:
        import numpy as np
        import torch
        import transformers
    except ImportError as e:
        print(f"SKIPPED: {e} (scripts/setup.sh installs torch and transformers for "
              f"{sys.executable})")
        return SKIP
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"python {sys.executable}")

    dump = os.path.join(a.work, "dump")
    run_stage(a, dump)
    tokens, targets, loss, weights, grads = load_dump(a, dump)
    if not np.array_equal(targets[:-1], tokens[1:]):
        fail("targets are not the next tokens of the stream (targets[s] = tokens[s + 1])")
    hf_loss, hf_grads = transformers_lm(a, tokens, targets, weights, a.rope_theta)
    print(f"loss: 01_baseline {loss:.8f}, transformers {hf_loss:.8f}")
    ok = compare(loss, grads, hf_loss, hf_grads)
    print("PASS" if ok else "FAIL")
    if not ok or not a.self_test:
        return 0 if ok else 1

    print("\nself-test: each change below must make the comparison fail")
    caught = []
    # One weight element changed before transformers runs (by 5 of init's 0.02 standard deviations).
    changed = dict(weights)
    name = f"layers.{a.layers - 1}.wv"
    changed[name] = weights[name].copy()
    changed[name][0, 0] += 0.1
    l2, g2 = transformers_lm(a, tokens, targets, changed, a.rope_theta)
    print(f"- {name}[0, 0] += 0.1 before transformers runs:")
    caught.append(not compare(loss, grads, l2, g2, quiet=True))
    # One element of one of our gradients off by 0.1 % of that gradient's largest value.
    name = "layers.0.w_down"
    off = dict(grads)
    off[name] = grads[name].copy()
    off[name][1, 2] += 1e-3 * np.abs(hf_grads[name]).max()
    print(f"- our {name}.grad[1, 2] off by 1e-3 of its largest value:")
    caught.append(not compare(loss, off, hf_loss, hf_grads, quiet=True))
    # transformers at another RoPE theta.
    theta = 10000.0 if a.rope_theta != 10000.0 else 500000.0
    l3, g3 = transformers_lm(a, tokens, targets, weights, theta)
    print(f"- transformers at rope_theta {theta:g} instead of {a.rope_theta:g}:")
    caught.append(not compare(loss, grads, l3, g3, quiet=True))
    for i, c in enumerate(caught):
        if not c:
            print(f"self-test: change {i + 1} was NOT caught")
    print("self-test PASS" if all(caught) else "self-test FAIL")
    return 0 if all(caught) else 1


if __name__ == "__main__":
    sys.exit(main())
