#!/usr/bin/env python3
"""Stage 10's language model with experts against Hugging Face transformers' MixtralForCausalLM.

Runs 10_expert_parallel --task lm for one step with --dump: every layer a mixture of E experts,
top K by softmax with the chosen probabilities renormalised (Mixtral's rule), dropless, no
auxiliary loss (Mixtral's training loss adds it only when asked), no shared experts. Builds a
MixtralForCausalLM with the same config (no router jitter, no sliding window, eager attention),
loads the dumped initial weights into it (the router [H, E] as gate.weight [E, H], each expert's
w_gate, w_up [H, FE] and w_down [FE, H] as w1, w3 and w2 transposed; attention, norms and the ends
as tests/lm_transformers.py maps them), runs it in float64 on the dumped tokens, and compares the
loss and every gradient, the router's and each expert's included, one row each.

    moe_transformers.py --bin build/bin/10_expert_parallel --work DIR [--mpirun "..."] [--np N]
                        [--python .venv-hf/bin/python] [--experts E --topk K] [--self-test]

--self-test also shows the comparison can fail: Mixtral's weights not renormalised (its
norm_topk_prob-less rule) and one expert's w2 element changed must each be caught.

Exit status: 0 pass, 1 mismatch (or a self-test change not caught), 2 bad input or a failed run,
77 (a skip for ctest) where numpy, torch or transformers cannot be imported.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm_transformers as lm  # noqa: E402  (its dump reader, comparison and constants)
from under_python import rerun_under  # noqa: E402

SKIP = 77
MLP = ("w_gate", "w_up", "w_down")


def fail(message):
    print(f"moe_transformers: error: {message}", file=sys.stderr)
    sys.exit(2)


def names(a):
    """Our tensor name -> (transformers' name, stored transposed): the dense model's without its
    SwiGLU, and the router and every expert of every layer."""
    out = {k: v for k, v in lm.hf_names(a.layers).items() if k.rsplit(".", 1)[-1] not in MLP}
    for l in range(a.layers):
        moe = f"model.layers.{l}.block_sparse_moe"
        out[f"layers.{l}.router"] = (f"{moe}.gate.weight", True)
        for e in range(a.experts):
            for ours, hf in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
                out[f"layers.{l}.experts.{e}.{ours}"] = (f"{moe}.experts.{e}.{hf}.weight", True)
    return out


def load_dump(a, dump):
    np = lm.np
    tokens = np.load(os.path.join(dump, "tokens.npy"))
    targets = np.load(os.path.join(dump, "targets.npy"))
    loss = float(np.load(os.path.join(dump, "loss.npy"))[0])
    weights, grads = {}, {}
    for name in names(a):
        path = os.path.join(dump, name + ".npy")
        if not os.path.exists(path):
            fail(f"{path}: not in the dump")
        weights[name] = np.load(path).astype(np.float64)
        grads[name] = np.load(os.path.join(dump, name + ".grad.npy")).astype(np.float64)
    return tokens, targets, loss, weights, grads


def mixtral_lm(a, tokens, targets, weights, renormalise=True):
    """MixtralForCausalLM in float64 with our weights: the loss and every gradient, our layout."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        hidden_act="silu", max_position_embeddings=a.seq, rms_norm_eps=lm.EPS,
        rope_theta=a.rope_theta, sliding_window=None, num_local_experts=a.experts,
        num_experts_per_tok=a.topk, router_jitter_noise=0.0, output_router_logits=False,
        tie_word_embeddings=False, attention_dropout=0.0, use_cache=False,
        attn_implementation="eager")
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).double()
    params = dict(model.named_parameters())
    mapping = names(a)
    if set(params) != {hf for hf, _ in mapping.values()}:
        fail(f"MixtralForCausalLM's parameters are not the ones mapped here: {sorted(params)}")
    if not renormalise:  # the self-test's wrong rule: the top-k softmax probabilities as they are
        for layer in model.model.layers:
            moe = layer.block_sparse_moe  # the same experts chosen, their weights as they are

            def forward(hidden, moe=moe):
                b, s, h = hidden.shape
                x = hidden.view(-1, h)
                probs = torch.softmax(moe.gate(x), dim=1, dtype=torch.float64)
                weight, chosen = torch.topk(probs, moe.top_k, dim=-1)
                out = torch.zeros_like(x)
                for j in range(moe.top_k):
                    for e in range(moe.num_experts):
                        rows = chosen[:, j] == e
                        if rows.any():
                            out[rows] += weight[rows, j, None] * moe.experts[e](x[rows])
                return out.view(b, s, h), None
            moe.forward = forward
    return lm.loss_and_grads(model, mapping, weights, tokens, targets)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, help="the 10_expert_parallel executable")
    ap.add_argument("--work", required=True, help="a directory for the dump (replaced)")
    ap.add_argument("--mpirun", default="", help="launcher and its flags; -np N is added")
    ap.add_argument("--np", type=int, default=1, help="ranks (the mesh is the stage's default)")
    ap.add_argument("--vocab", type=int, default=101)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=48)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rope-theta", type=float, default=1.0e6)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--python", help="run under this interpreter when it exists")
    a = ap.parse_args()
    rerun_under(a.python, __file__)
    try:
        import numpy
        import torch
        import transformers
    except ImportError as e:
        print(f"SKIPPED: {e} (scripts/setup.sh installs torch and transformers for "
              f"{sys.executable})")
        return SKIP
    lm.np = numpy
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")

    dump = os.path.join(a.work, "dump")
    lm.run_stage(a, dump, ["--experts", str(a.experts), "--topk", str(a.topk), "--expert-ffn",
                           str(a.ffn), "--router", "softmax", "--aux-loss-weight", "0"], a.np)
    tokens, targets, loss, weights, grads = load_dump(a, dump)
    hf_loss, hf_grads = mixtral_lm(a, tokens, targets, weights)
    print(f"loss: 10_expert_parallel {loss:.8f}, transformers {hf_loss:.8f}")
    ok = lm.compare(loss, grads, hf_loss, hf_grads)
    print("PASS" if ok else "FAIL")
    if not ok or not a.self_test:
        return 0 if ok else 1

    print("\nself-test: each change below must make the comparison fail")
    caught = []
    l2, g2 = mixtral_lm(a, tokens, targets, weights, renormalise=False)
    print("- Mixtral's top-k probabilities not renormalised:")
    caught.append(not lm.compare(loss, grads, l2, g2, quiet=True))
    changed = dict(weights)
    name = f"layers.{a.layers - 1}.experts.{a.experts - 1}.w_down"
    changed[name] = weights[name].copy()
    changed[name][0, 0] += 0.1
    l3, g3 = mixtral_lm(a, tokens, targets, changed)
    print(f"- {name}[0, 0] += 0.1 before transformers runs:")
    caught.append(not lm.compare(loss, grads, l3, g3, quiet=True))
    for i, c in enumerate(caught):
        if not c:
            print(f"self-test: change {i + 1} was NOT caught")
    print("self-test PASS" if all(caught) else "self-test FAIL")
    return 0 if all(caught) else 1


if __name__ == "__main__":
    sys.exit(main())
