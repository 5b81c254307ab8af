#!/usr/bin/env python3
"""The double-precision MoE MLP (common/moe.h) against PyTorch autograd in float64.

For each case below, makes the inputs and weights here (numpy, seeded), runs the reference through
tests/moe_reference (IN.json -> OUT.json), and computes the same MLP in torch from the rules of
common/moe.h, routing included (written again here, not read from the reference): the router
linear, softmax (Mixtral: the top-k probabilities renormalised) or sigmoid (DeepSeek-V3: the top-k
scores renormalised) scores, the bias added for the choice only, ties to the lower expert index,
capacity ceil(C·T·k/E) filled in token order, the shared experts (NS of width FE: one SwiGLU of
width NS·FE), and the auxiliary loss
W·E·Σ f_e·P_e. The loss is ½·mean((y − target)²) + L_aux. Compared: the routing (chosen experts,
drops, counts: exactly; gate weights), the loss, the auxiliary loss, y, and the gradients of x,
the router and every expert's three matrices, each as max |ours − torch| / max |torch|.

    moe_torch.py --bin build/bin/moe_reference --work DIR [--python PYTHON] [--self-test]

--self-test then shows the comparison can fail: Mixtral's weights without renormalisation in
torch, ties broken by the higher index in torch, and one element of one of the reference's
gradients off by 1e-9 of that gradient's largest value must each be caught.

Exit status: 0 pass, 1 mismatch (or a self-test change not caught), 2 a failed run of the
reference, 77 (a skip for ctest) where numpy or torch cannot be imported.
"""
import argparse
import json
import math
import os
import subprocess
import sys

from under_python import rerun_under

SKIP = 77
# Both sides in float64 over a few dozen operations per value: differences of a few 1e-16 of the
# tensor's scale. 1e-11 leaves room for that and catches an element off by 1e-9 (the self-test).
TOLERANCE = 1e-11
np = None
torch = None

# name, router, topk, experts, capacity factor, shared experts NS, aux weight, routing, bias
# routing: "balanced" (small random router), "skewed" (low experts favoured), "tie" (experts 1
# and 2 with the same router column, ahead of the others).
CASES = [
    ("softmax_dropless_balanced", "softmax", 2, 4, 0.0, 0, 0.0, "balanced", False),
    ("softmax_dropping_skewed_shared_aux", "softmax", 2, 4, 1.0, 1, 0.01, "skewed", False),
    ("softmax_top1_dropping_skewed_bias_aux", "softmax", 1, 4, 1.5, 0, 0.1, "skewed", True),
    ("softmax_tie_top1_aux", "softmax", 1, 4, 0.0, 1, 0.01, "tie", False),
    ("sigmoid_dropless_skewed_2shared_aux_bias", "sigmoid", 2, 4, 0.0, 2, 0.1, "skewed", True),
    ("sigmoid_dropping_balanced_aux", "sigmoid", 2, 4, 1.0, 0, 0.01, "balanced", False),
    ("sigmoid_top3_of_8_dropping_skewed_shared", "sigmoid", 3, 8, 1.0, 1, 0.0, "skewed",
     False),
    ("sigmoid_tie_top1_dropping", "sigmoid", 1, 4, 1.0, 0, 0.01, "tie", False),
]
TOKENS, HIDDEN, FFN = 24, 8, 6


def fail(message):
    print(f"moe_torch: error: {message}", file=sys.stderr)
    sys.exit(2)


def make_case(index, case):
    name, router, topk, experts, capacity, shared, aux, routing, bias = case
    rng = np.random.default_rng(1000 + index)
    T, H, E, F = TOKENS, HIDDEN, experts, FFN
    c = {"tokens": T, "hidden": H, "experts": E, "topk": topk, "expert_ffn": F,
         "shared_ffn": shared * F, "router": router, "capacity_factor": capacity,
         "aux_loss_weight": aux}
    x = rng.normal(0.0, 1.0, (T, H))
    R = rng.normal(0.0, 0.3, (H, E))
    if routing == "skewed":
        x[:, 0] = np.abs(x[:, 0]) + 1.0          # feature 0 positive on every token
        R[0, :] += 2.0 * (E - np.arange(E)) / E  # ... and worth most to the low experts
    if routing == "tie":
        x[:, 0] = np.abs(x[:, 0]) + 1.0
        R[:, 2] = R[:, 1]
        R[0, 1] = R[0, 2] = R[0, 1] + 4.0
    c["x"] = x
    c["w_router"] = R
    c["target"] = rng.normal(0.0, 1.0, (T, H))
    c["bias"] = rng.normal(0.0, 0.05, E) if bias else np.zeros(0)
    c["w_gate"] = rng.normal(0.0, 0.4, (E, H, F))
    c["w_up"] = rng.normal(0.0, 0.4, (E, H, F))
    c["w_down"] = rng.normal(0.0, 0.4, (E, F, H))
    if shared:
        SF = shared * F
        c["shared_gate"] = rng.normal(0.0, 0.4, (H, SF))
        c["shared_up"] = rng.normal(0.0, 0.4, (H, SF))
        c["shared_down"] = rng.normal(0.0, 0.4, (SF, H))
    return name, c


def run_reference(a, name, c):
    os.makedirs(a.work, exist_ok=True)
    src = os.path.join(a.work, f"{name}.in.json")
    dst = os.path.join(a.work, f"{name}.out.json")
    with open(src, "w") as f:
        json.dump({k: (v.ravel().tolist() if isinstance(v, np.ndarray) else v)
                   for k, v in c.items()}, f)
    r = subprocess.run([a.bin, src, dst], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    if r.returncode != 0:
        print(r.stdout)
        fail(f"moe_reference exited {r.returncode} on {name}")
    with open(dst) as f:
        return json.load(f)


def route(c, scores, renormalise=True, lower_index_wins=True):
    """The choice, drops and gate weights from the scores (torch [T, E]), by the rules."""
    T, E, k = c["tokens"], c["experts"], c["topk"]
    sel = scores.detach().numpy() + (c["bias"] if len(c["bias"]) else 0.0)
    C = c["capacity_factor"]
    capacity = min(T, math.ceil(C * T * k / E)) if C > 0 else T
    experts, kept = [], []
    routed = [0] * E
    served = [0] * E
    for t in range(T):
        tie = (lambda e: e) if lower_index_wins else (lambda e: -e)
        order = sorted(range(E), key=lambda e: (-sel[t, e], tie(e)))[:k]
        experts.append(order)
        row = []
        for e in order:
            row.append(routed[e] < capacity)
            served[e] += routed[e] < capacity
            routed[e] += 1
        kept.append(row)
    idx = torch.tensor(experts)
    chosen = torch.gather(scores, 1, idx)
    weight = chosen / chosen.sum(dim=1, keepdim=True) if renormalise else chosen
    return experts, kept, weight, routed, served, capacity


def torch_moe(c, renormalise=True, lower_index_wins=True):
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
         for k, v in c.items() if isinstance(v, np.ndarray) and k not in ("target", "bias")}
    T, E, k = c["tokens"], c["experts"], c["topk"]
    z = t["x"] @ t["w_router"]
    scores = torch.softmax(z, dim=1) if c["router"] == "softmax" else torch.sigmoid(z)
    experts, kept, weight, routed, served, capacity = route(c, scores, renormalise,
                                                            lower_index_wins)

    def swiglu(x, wg, wu, wd):
        g = x @ wg
        return (torch.nn.functional.silu(g) * (x @ wu)) @ wd

    rows = []
    for i in range(T):
        xi = t["x"][i:i + 1]
        yi = torch.zeros(1, c["hidden"], dtype=torch.float64)
        for j in range(k):
            if kept[i][j]:
                e = experts[i][j]
                yi = yi + weight[i, j] * swiglu(xi, t["w_gate"][e], t["w_up"][e], t["w_down"][e])
        if c["shared_ffn"]:
            yi = yi + swiglu(xi, t["shared_gate"], t["shared_up"], t["shared_down"])
        rows.append(yi)
    y = torch.cat(rows)
    target = torch.tensor(c["target"], dtype=torch.float64)
    loss = 0.5 * ((y - target) ** 2).mean()
    aux = torch.zeros((), dtype=torch.float64)
    if c["aux_loss_weight"]:
        q = scores if c["router"] == "softmax" else scores / scores.sum(dim=1, keepdim=True)
        f = torch.tensor(routed, dtype=torch.float64) / (T * k)
        aux = c["aux_loss_weight"] * E * (f * q.mean(dim=0)).sum()
    (loss + aux).backward()
    grads = {name: v.grad.numpy().ravel() for name, v in t.items()}
    return {"loss": loss.item(), "aux_loss": aux.item(), "y": y.detach().numpy().ravel(),
            "expert": experts, "kept": kept, "weight": weight.detach().numpy().ravel(),
            "routed_per_expert": routed, "tokens_per_expert": served, "capacity": capacity,
            "grads": grads}


def rel(ours, want):
    ours, want = np.asarray(ours, dtype=np.float64).ravel(), np.asarray(want).ravel()
    if ours.shape != want.shape:
        return math.inf
    scale = max(np.max(np.abs(want)), 1e-300)
    return float(np.max(np.abs(ours - want)) / scale)


def compare(ours, want, quiet=False):
    """Prints one row per quantity; True if all agree."""
    ok = True

    def row(what, good, detail):
        nonlocal ok
        ok = ok and good
        if not quiet:
            print(f"  {what:<22} {detail:<28} {'ok' if good else 'MISMATCH'}")

    k = len(want["expert"][0])
    same_route = (np.asarray(ours["expert"]).reshape(-1, k).tolist() == want["expert"] and
                  np.asarray(ours["kept"]).reshape(-1, k).astype(bool).tolist() == want["kept"])
    row("routing", same_route, "experts and drops equal" if same_route else "differ")
    for name in ("routed_per_expert", "tokens_per_expert", "capacity"):
        row(name, ours[name] == want[name], f"{ours[name]} vs {want[name]}")
    for name in ("loss", "aux_loss", "weight", "y"):
        e = rel(ours[name], want[name])
        row(name, e <= TOLERANCE, f"rel err {e:.2e}")
    for name, g in want["grads"].items():
        e = rel(ours["grads"].get(name, []), g)
        row(f"grad {name}", e <= TOLERANCE, f"rel err {e:.2e}")
    return ok


def check_case_shape(name, c, out):
    """The case tests what its name says: drops where it drops, none where dropless, a skew."""
    E, T, k = c["experts"], c["tokens"], c["topk"]
    routed, served = out["routed_per_expert"], out["tokens_per_expert"]
    dropped = sum(routed) - sum(served)
    if c["capacity_factor"] == 0 and dropped:
        fail(f"{name}: dropless but {dropped} assignments dropped")
    if "dropping" in name and dropped == 0:
        fail(f"{name}: no assignment dropped at capacity {out['capacity']}")
    if "skewed" in name and max(routed) < 1.5 * T * k / E:
        fail(f"{name}: routing not skewed ({routed})")
    if "tie" in name and (routed[2] != 0 or routed[1] != T * k):
        fail(f"{name}: the tie between experts 1 and 2 did not go to 1 on every token ({routed})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, help="the moe_reference executable")
    ap.add_argument("--work", required=True, help="a directory for the cases' json files")
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--python", help="run under this interpreter when it exists")
    a = ap.parse_args()
    rerun_under(a.python, __file__)
    global np, torch
    try:
        import numpy as np
        import torch
    except ImportError as e:
        print(f"SKIPPED: {e} (python {sys.executable})")
        return SKIP
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, python {sys.executable}")

    ok = True
    cases = []
    for i, case in enumerate(CASES):
        name, c = make_case(i, case)
        ours = run_reference(a, name, c)
        check_case_shape(name, c, ours)
        print(f"{name}: tokens per expert {ours['tokens_per_expert']} "
              f"(routed {ours['routed_per_expert']}, capacity {ours['capacity']})")
        good = compare(ours, torch_moe(c))
        ok = ok and good
        cases.append((name, c, ours))
    print("PASS" if ok else "FAIL")
    if not ok or not a.self_test:
        return 0 if ok else 1

    print("\nself-test: each change below must make the comparison fail")
    caught = []
    name, c, ours = cases[1]
    caught.append(not compare(ours, torch_moe(c, renormalise=False), quiet=True))
    print(f"- {name}, torch without renormalising the top-k weights: "
          f"{'caught' if caught[-1] else 'NOT caught'}")
    name, c, ours = cases[3]
    caught.append(not compare(ours, torch_moe(c, lower_index_wins=False), quiet=True))
    print(f"- {name}, torch breaking ties by the higher index: "
          f"{'caught' if caught[-1] else 'NOT caught'}")
    name, c, ours = cases[4]
    off = json.loads(json.dumps(ours))
    g = off["grads"]["w_router"]
    g[3] += 1e-9 * max(abs(v) for v in g)
    caught.append(not compare(off, torch_moe(c), quiet=True))
    print(f"- {name}, grad w_router[3] off by 1e-9 of its largest value: "
          f"{'caught' if caught[-1] else 'NOT caught'}")
    print("PASS" if all(caught) else "FAIL")
    return 0 if all(caught) else 1


if __name__ == "__main__":
    sys.exit(main())
