#!/usr/bin/env python3
"""A tpx checkpoint as a Hugging Face Llama directory, and back.

    tpx_hf.py export CHECKPOINT OUT [--rope-theta THETA] [--max-position N]
    tpx_hf.py import HF_DIR OUT --seed SEED [--data FILE] [--optimizer sgd|adamw]
                     [--dtype fp32|bf16]

export reads a checkpoint (a step-<N> directory with its index.json, or a --save directory, whose
latest valid step it takes), puts every tensor of the model together from its shards (each shard's
box in the global tensor, its chunks checked against their CRC-32) and writes OUT/config.json and
OUT/model.safetensors as transformers' LlamaForCausalLM names and lays them out:

    embedding        [V, H]          model.embed_tokens.weight        [V, H]
    layers.l.norm1   [H]             model.layers.l.input_layernorm.weight
    layers.l.wq      [H, NH·D]       model.layers.l.self_attn.q_proj.weight   [NH·D, H] (W^T)
    layers.l.wk, wv  [H, NKV·D]      ...self_attn.k_proj / v_proj.weight      [NKV·D, H]
    layers.l.wo      [H, H]          ...self_attn.o_proj.weight               (W^T)
    layers.l.norm2   [H]             ...post_attention_layernorm.weight
    layers.l.w_gate, w_up [H, F]     ...mlp.gate_proj / up_proj.weight        [F, H]
    layers.l.w_down  [F, H]          ...mlp.down_proj.weight                  [H, F]
    norm_f           [H]             model.norm.weight
    w_out            [H, V]          lm_head.weight                           [V, H]

An nn.Linear holds W^T of our [in, out] weights. The q and k rows need no permutation: tpx rotates
the pairs (i, i + Dh/2) of each head, transformers' rotate_half convention (Meta's original
checkpoints pair (2i, 2i + 1), which is why their converter permutes those rows); the test
tests/hf_checkpoint.py shows the loss of the exported model equal to tpx's.

import is the inverse: a LlamaForCausalLM directory (model.safetensors, or its index of several
files, and config.json) becomes OUT/step-0/, a one-rank checkpoint at step 0 that any stage
resumes (`--resume OUT` with the same --seed, --data, --optimizer and --dtype, and --steps the
steps to train). AdamW's moments start at zero, as a fresh run's. The model must have no biases,
untied embeddings, RMSNorm ε 1e-5 and SiLU; anything else is refused, naming the field.

safetensors (https://github.com/huggingface/safetensors) reads and writes the tensors: it comes
with transformers (scripts/setup.sh --transformers puts both in .venv-hf). Exit status: 0, 2 on
bad input (one line naming the file and what is wrong).
"""
import argparse
import json
import os
import pathlib
import sys
import zlib

FORMAT = "tpx-checkpoint"
VERSION = 1
CHUNK = 1 << 20
EPS = 1e-5  # DESIGN.md's RMSNorm ε
PARAMS = ["norm1", "wq", "wk", "wv", "wo", "norm2", "w_gate", "w_up", "w_down"]
# Our layer parameter -> (transformers' name inside model.layers.l, stored transposed).
HF_LAYER = {
    "norm1": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "norm2": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


class Refused(Exception):
    """Bad input: one line for the user, exit status 2."""


def hf_names(layers):
    """Our tensor name -> (transformers' name, stored transposed), in the model's order."""
    names = {"embedding": ("model.embed_tokens.weight", False)}
    for l in range(layers):
        for p in PARAMS:
            hf, transposed = HF_LAYER[p]
            names[f"layers.{l}.{p}"] = (f"model.layers.{l}.{hf}", transposed)
    names["norm_f"] = ("model.norm.weight", False)
    names["w_out"] = ("lm_head.weight", True)
    return names


def find_checkpoint(path):
    """A step-<N> directory with an index.json: `path` itself, or its latest valid one."""
    path = pathlib.Path(path)
    if (path / "index.json").is_file():
        return path
    steps = []
    if path.is_dir():
        for d in path.iterdir():
            if d.name.startswith("step-") and d.name[5:].isdigit() and (d / "index.json").is_file():
                steps.append((int(d.name[5:]), d))
    if not steps:
        raise Refused(f"'{path}': no checkpoint (no index.json, no step-<N> directory holding one)")
    return max(steps)[1]


def read_tensor(np, ckpt, index, t):
    """The global tensor `t` of the index put together from its shards, checksums verified."""
    name, shape = t["name"], t["shape"]
    out = np.zeros(shape, dtype=np.float32)
    covered = 0
    chunk = index["chunk_bytes"]
    for sh in t["shards"]:
        box = sh["box"]
        count = 1
        for _, length in box:
            count *= length
        path = ckpt / sh["file"]
        try:
            with open(path, "rb") as f:
                f.seek(sh["offset"])
                raw = f.read(4 * count)
        except OSError as e:
            raise Refused(f"'{path}': cannot be read ({e.strerror}), tensor '{name}'")
        if len(raw) != 4 * count:
            raise Refused(f"'{path}': truncated: tensor '{name}' needs {4 * count} bytes at offset "
                          f"{sh['offset']}, the file has {len(raw)}")
        crcs = [zlib.crc32(raw[at:at + chunk]) for at in range(0, len(raw), chunk)]
        if crcs != sh["crc32"]:
            bad = next(i for i, (a, b) in enumerate(zip(crcs, sh["crc32"])) if a != b) \
                if len(crcs) == len(sh["crc32"]) else 0
            raise Refused(f"'{path}': tensor '{name}': chunk {bad} does not match its CRC-32 "
                          "(the file is damaged)")
        part = np.frombuffer(raw, dtype="<f4").reshape([length for _, length in box])
        out[tuple(slice(start, start + length) for start, length in box)] = part
        covered += count
    if covered != int(np.prod(shape)):
        raise Refused(f"'{ckpt / 'index.json'}': the shards of '{name}' cover {covered} of its "
                      f"{int(np.prod(shape))} elements")
    return out


def export(a):
    import numpy as np
    from safetensors.numpy import save_file

    ckpt = find_checkpoint(a.checkpoint)
    try:
        index = json.loads((ckpt / "index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise Refused(f"'{ckpt / 'index.json'}': not readable ({e})")
    if index.get("format") != FORMAT:
        raise Refused(f"'{ckpt / 'index.json'}': not a tpx checkpoint index")
    if index.get("version", 0) > VERSION:
        raise Refused(f"'{ckpt / 'index.json'}': format version {index['version']} is newer than "
                      f"this tool reads ({VERSION})")
    m = index["model"]
    if m.get("task") != "lm":
        raise Refused(f"'{ckpt / 'index.json'}': a --task {m.get('task')} checkpoint has no "
                      "language model to export")
    tensors = {t["name"]: t for t in index["tensors"]}
    names = hf_names(m["layers"])
    out = {}
    for ours, (hf, transposed) in names.items():
        if ours not in tensors:
            raise Refused(f"'{ckpt / 'index.json'}': has no tensor '{ours}'")
        w = read_tensor(np, ckpt, index, tensors[ours])
        out[hf] = np.ascontiguousarray(w.T if transposed else w)
    theta = a.rope_theta if a.rope_theta is not None else m.get("rope_theta", 500000.0)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m["vocab"], "hidden_size": m["hidden"], "intermediate_size": m["ffn"],
        "num_hidden_layers": m["layers"], "num_attention_heads": m["heads"],
        "num_key_value_heads": m["kv_heads"], "hidden_act": "silu",
        "max_position_embeddings": a.max_position or m.get("seq", 8192), "rms_norm_eps": EPS,
        "rope_theta": theta, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    dest = pathlib.Path(a.out)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    print(f"exported {ckpt} (step {index['step']}) to {dest}: {len(out)} tensors")


def load_hf(np, src):
    """transformers' tensors of a directory (one safetensors file or its sharded index)."""
    from safetensors.numpy import load_file

    src = pathlib.Path(src)
    files = [src / "model.safetensors"]
    if not files[0].is_file():
        idx = src / "model.safetensors.index.json"
        if not idx.is_file():
            raise Refused(f"'{src}': no model.safetensors (nor model.safetensors.index.json)")
        files = sorted({src / f for f in json.loads(idx.read_text())["weight_map"].values()})
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types
            raise Refused(f"'{f}': not a readable safetensors file ({e})")
    return tensors


def import_(a):
    import numpy as np

    src = pathlib.Path(a.hf_dir)
    try:
        cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise Refused(f"'{src / 'config.json'}': not readable ({e})")
    rules = {"model_type": "llama", "hidden_act": "silu", "tie_word_embeddings": False,
             "attention_bias": False, "mlp_bias": False}
    for key, want in rules.items():
        if cfg.get(key, want) != want:
            raise Refused(f"'{src / 'config.json'}': {key} is {cfg[key]!r}; tpx's model has "
                          f"{want!r}")
    if abs(cfg.get("rms_norm_eps", EPS) - EPS) > 1e-12:
        raise Refused(f"'{src / 'config.json'}': rms_norm_eps is {cfg['rms_norm_eps']}; tpx's "
                      f"RMSNorm has {EPS}")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size"):
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise Refused(f"'{src / 'config.json'}': {key} must be a positive integer, not "
                          f"{cfg.get(key)!r}")
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    NH = cfg["num_attention_heads"]
    NKV = cfg.get("num_key_value_heads") or NH
    model = {"hidden": H, "heads": NH, "kv_heads": NKV, "ffn": cfg["intermediate_size"],
             "layers": L, "vocab": cfg["vocab_size"], "task": "lm", "dtype": a.dtype,
             "optimizer": a.optimizer, "rope_theta": cfg.get("rope_theta", 10000.0)}
    hf = load_hf(np, src)
    names = hf_names(L)
    state = []
    for ours, (hf_name, transposed) in names.items():
        if hf_name not in hf:
            raise Refused(f"'{src}': has no tensor '{hf_name}' (for tpx's '{ours}')")
        w = np.asarray(hf[hf_name], dtype=np.float32)
        state.append((ours, np.ascontiguousarray(w.T if transposed else w)))
    extra = set(hf) - {n for n, _ in names.values()} - {
        k for k in hf if k.endswith("rotary_emb.inv_freq")}
    if extra:
        raise Refused(f"'{src}': tensor '{sorted(extra)[0]}' has no place in tpx's model")
    if a.optimizer == "adamw":
        state += [(n + m, np.zeros_like(w)) for m in (".adamw_m", ".adamw_v") for n, w in state]
    dest = pathlib.Path(a.out)
    step_dir = dest / "step-0"
    if step_dir.exists():
        raise Refused(f"'{step_dir}': exists already (import writes a new checkpoint)")
    staging = dest / "step-0.tmp"
    staging.mkdir(parents=True, exist_ok=True)
    tensors, offset = [], 0
    with open(staging / "rank-0.bin", "wb") as f:
        for name, w in state:
            raw = w.astype("<f4").tobytes()
            f.write(raw)
            tensors.append({"name": name, "shape": list(w.shape), "dtype": "f32", "shards": [{
                "file": "rank-0.bin", "offset": offset,
                "box": [[0, n] for n in w.shape],
                "crc32": [zlib.crc32(raw[at:at + CHUNK]) for at in range(0, len(raw), CHUNK)]}]})
            offset += len(raw)
        f.flush()
        os.fsync(f.fileno())
    index = {"format": FORMAT, "version": VERSION, "step": 0, "model": model,
             "data": {"source": a.data, "seed": a.seed, "next_step": 0},
             "saved_by": {"world_size": 1, "tensor_parallel": False,
                          "imported_from": str(src)},
             "chunk_bytes": CHUNK, "tensors": tensors}
    with open(staging / "index.json", "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(staging, step_dir)
    print(f"imported {src} to {step_dir}: {len(state)} tensors; resume it with --resume {dest} "
          f"--seed {a.seed}" + (f" --data {a.data}" if a.data else "") +
          f" --optimizer {a.optimizer} --dtype {a.dtype}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="a checkpoint to a Hugging Face Llama directory")
    e.add_argument("checkpoint", help="a step-<N> directory, or a --save DIR (its latest step)")
    e.add_argument("out", help="the directory to write config.json and model.safetensors into")
    e.add_argument("--rope-theta", type=float, help="RoPE θ (default: the checkpoint's)")
    e.add_argument("--max-position", type=int, help="max_position_embeddings (default: S)")
    i = sub.add_parser("import", help="a Hugging Face Llama directory to a checkpoint at step 0")
    i.add_argument("hf_dir", help="a directory with config.json and model.safetensors")
    i.add_argument("out", help="the checkpoint directory (--resume OUT); step-0 is made in it")
    i.add_argument("--seed", type=int, required=True, help="the --seed the runs will give")
    i.add_argument("--data", default=None, help="the --data token file the runs will give")
    i.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    i.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    a = ap.parse_args()
    try:
        import numpy  # noqa: F401
        import safetensors  # noqa: F401
    except ImportError as err:
        print(f"tpx_hf.py: {err.name} is missing (scripts/setup.sh --transformers installs it in "
              ".venv-hf)", file=sys.stderr)
        return 2
    try:
        export(a) if a.command == "export" else import_(a)
    except Refused as err:
        print(f"tpx_hf.py {a.command}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
