#!/usr/bin/env python3
"""A tpx checkpoint through tools/tpx_hf.py to transformers' LlamaForCausalLM, and back.

    hf_checkpoint.py --bin build/bin/01_baseline --work DIR --data FILE --vocab V
                     [--mpirun "mpiexec FLAGS"] [--python .venv-hf/bin/python]

export: 01_baseline trains two steps and saves; a resumed run dumps its first step (step 2: the
saved weights, that step's tokens and loss). tpx_hf.py exports the checkpoint, transformers'
`LlamaForCausalLM.from_pretrained` loads it, every parameter equals the dumped weight (W^T for an
nn.Linear) bit for bit, and its loss on the dumped tokens equals the dumped loss within 1e-5.

import: a LlamaForCausalLM initialised by transformers is saved with `save_pretrained`
(safetensors), imported by tpx_hf.py, resumed by 01_baseline for eight AdamW steps on the real
text (--data, its vocabulary --vocab): the first step's
dumped weights equal transformers' bit for bit, its loss equals transformers' loss on those
tokens within 1e-5, and the loss falls.

Also: a damaged shard (one byte flipped) is refused by the export with exit 2, naming the file.
Exit status: 0 pass, 1 mismatch, 2 a failed run, 77 (ctest's skip) without numpy, torch,
transformers or safetensors.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys

from under_python import rerun_under

SKIP = 77
TOLERANCE = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "tpx_hf.py")
SIZES = ["--task", "lm", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
         "--seq", "16", "--batch", "2", "--layers", "2", "--rope-theta", "10000", "--seed", "1234"]
SYNTHETIC = ["--data", "synthetic", "--vocab", "101"]


def fail(message):
    print(f"FAIL: {message}")
    sys.exit(1)


def run(cmd, expect=0):
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != expect:
        print(r.stdout)
        print(f"exit status {r.returncode}, expected {expect}")
        sys.exit(2)
    return r.stdout


def stage(a, *flags):
    cmd = (shlex.split(a.mpirun) + ["-np", "1"] if a.mpirun else []) + [a.bin] + SIZES
    return run(cmd + list(flags))


def tool(*args, expect=0):
    return run([sys.executable, TOOL] + list(args), expect)


def dumped(np, dump):
    """The dump's tokens, targets, loss and weights (our names)."""
    out = {n[:-4]: np.load(os.path.join(dump, n)) for n in os.listdir(dump)
           if n.endswith(".npy") and not n.endswith(".grad.npy")}
    return out["tokens"], out["targets"], float(out["loss"][0]), out


def hf_loss(torch, model, tokens, targets):
    ids = torch.from_numpy(tokens.T.astype("int64"))  # [B, S]: transformers is batch first
    tgt = torch.from_numpy(targets.T.astype("int64"))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double()
    target = logits.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    return float((torch.logsumexp(logits, dim=-1) - target).mean())


def same_weights(np, model, weights, names, what):
    params = dict(model.named_parameters())
    for ours, (hf, transposed) in names.items():
        w = params[hf].detach().float().numpy()
        want = weights[ours].T if transposed else weights[ours]
        if w.shape != want.shape or not np.array_equal(w, want):
            fail(f"{what}: transformers' {hf} differs from tpx's {ours}")
    print(f"{what}: all {len(names)} tensors equal bit for bit")


def close(a, b, what):
    rel = abs(a - b) / abs(b)
    print(f"{what}: tpx {a:.8f}, transformers {b:.8f}, relative difference {rel:.2e}")
    if rel > TOLERANCE:
        fail(f"{what} differs by {rel:.2e} > {TOLERANCE}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, help="the 01_baseline executable")
    ap.add_argument("--work", required=True, help="a directory for the runs (replaced)")
    ap.add_argument("--mpirun", default="", help="launcher and its flags; -np 1 is added")
    ap.add_argument("--data", required=True, help="a token file of real text (the build's)")
    ap.add_argument("--vocab", type=int, required=True, help="its vocabulary")
    ap.add_argument("--python", help="run under this interpreter when it exists")
    a = ap.parse_args()
    rerun_under(a.python, __file__)
    try:
        import numpy as np
        import safetensors  # noqa: F401
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        print(f"SKIPPED: {e} (scripts/setup.sh --transformers installs them for "
              f"{sys.executable})")
        return SKIP
    if not os.path.isfile(a.data):
        print(f"SKIPPED: no token file '{a.data}' (the build makes it where Debian's bible-kjv is "
              "installed: scripts/setup.sh)")
        return SKIP
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(TOOL))
    from tpx_hf import hf_names
    names = hf_names(2)

    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    w = lambda *p: os.path.join(a.work, *p)  # noqa: E731

    # Export: the checkpoint of step 2 against the resumed run's first step.
    stage(a, *SYNTHETIC, "--steps", "2", "--save", w("ckpt"))
    stage(a, *SYNTHETIC, "--steps", "3", "--resume", w("ckpt"), "--dump", w("dump"))
    tokens, targets, loss, weights = dumped(np, w("dump"))
    tool("export", w("ckpt"), w("hf"))
    config = json.load(open(w("hf", "config.json")))
    if config["rope_theta"] != 10000.0 or config["max_position_embeddings"] < 16:
        fail(f"config.json has rope_theta {config['rope_theta']} and max_position_embeddings "
             f"{config['max_position_embeddings']}; the run had 10000 and S 16")
    model = LlamaForCausalLM.from_pretrained(w("hf"), torch_dtype=torch.float64,
                                             attn_implementation="eager")
    same_weights(np, model, weights, names, "export")
    close(loss, hf_loss(torch, model, tokens, targets), "export: loss at step 2")

    # Import: a model transformers initialised, trained by tpx on the real text with AdamW.
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                         attn_implementation="eager")
    torch.manual_seed(7)
    init = LlamaForCausalLM(config)
    init.save_pretrained(w("hf_init"), safe_serialization=True)
    tool("import", w("hf_init"), w("imported"), "--seed", "1234", "--data", a.data,
         "--optimizer", "adamw")
    stage(a, "--data", a.data, "--steps", "8", "--optimizer", "adamw", "--lr", "3e-3",
          "--resume", w("imported"), "--dump", w("dump2"), "--json", w("run.json"))
    tokens, targets, loss, weights = dumped(np, w("dump2"))
    same_weights(np, init, weights, names, "import")
    init = init.double()
    close(loss, hf_loss(torch, init, tokens, targets), "import: loss at step 0")
    losses = [s["loss"] for s in json.load(open(w("run.json")))["steps"]]
    print("import: losses " + " ".join(f"{x:.4f}" for x in losses))
    if not losses[-1] < losses[0]:
        fail("the imported model did not learn: the loss did not fall")

    # A damaged shard: the export refuses it.
    step = os.path.join(w("ckpt"), "step-2")
    with open(os.path.join(step, "rank-0.bin"), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    out = tool("export", step, w("hf_bad"), expect=2)
    if "rank-0.bin" not in out or "CRC-32" not in out:
        fail(f"the damaged shard's refusal does not name the file and the checksum: {out}")
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
