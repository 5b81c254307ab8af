#!/usr/bin/env python3
"""Instructions per tensor-core op in the fused-attention kernels' main loops, read from the
build's sm_90 SASS (nvdisasm of the cubin common/cuda/CMakeLists.txt compiles for the ctest
flash_resources), against the budgets written in the kernels' header.

A kernel's main loop is the loop (a backward branch and the instructions from its target to it)
whose body holds the most HMMA instructions; its count is the body's instructions over its HMMA,
static (each instruction of the body once). Every mma.sync instance (flash_forward_mma and
flash_bwd_mma at D = 32, 64, 128, bf16 and fp32 outputs) must have a budget line
in the header and stay at or below it, and every budget line must match a kernel:

    //   sass budget  flash_forward   27.0   16.9   10.6      (D = 32, 64, 128)

Exits 77 (ctest: skipped, with the reason printed) when no nvdisasm is found: scripts/setup.sh
--nvdisasm installs it from PyPI into .venv-nvdisasm where nvcc is found.

usage: check_flash_sass.py CUBIN HEADER [--nvdisasm PATH]
"""
import argparse
import glob
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SKIP = 77
SECTION = re.compile(r"^\.text\.(\S+):$")
INSN = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+([^;]*);")
LABEL = re.compile(r"^(\.L_x_\d+):$")
BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
HMMA = re.compile(r"\bHMMA\b")
KERNEL = re.compile(r"(flash_[a-z]+)_mmaILi(\d+)E")
BUDGET = re.compile(r"^//\s+sass budget\s+(flash_[a-z]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")
DIMS = (32, 64, 128)


def find_nvdisasm(given):
    if given:
        return given
    found = sorted(glob.glob(str(ROOT / ".venv-nvdisasm/lib/python3*/site-packages/nvidia/*/bin/nvdisasm")))
    return found[-1] if found else shutil.which("nvdisasm")


def functions(sass):
    """[(mangled name, [instruction text], {label: index of the instruction after it})]."""
    out = []
    for line in (raw.rstrip() for raw in sass.splitlines()):
        if m := SECTION.match(line):
            out.append((m.group(1), [], {}))
        elif out and (m := LABEL.match(line)):
            out[-1][2][m.group(1)] = len(out[-1][1])
        elif out and (m := INSN.match(line)):
            out[-1][1].append(m.group(1).strip())
    return out


def main_loop(insns, labels):
    """(HMMA, instructions) of the loop whose body holds the most HMMA (the shorter on a tie)."""
    best = None
    for end, text in enumerate(insns):
        m = BRANCH.search(text)
        start = labels.get(m.group(1)) if m else None
        if start is None or start > end:
            continue
        body = insns[start:end + 1]
        mma = sum(1 for t in body if HMMA.search(t))
        if mma and (best is None or (mma, -len(body)) > (best[0], -best[1])):
            best = (mma, len(body))
    return best


def budgets(header):
    out = {}
    for line in open(header):
        if m := BUDGET.match(line.rstrip()):
            for d, value in zip(DIMS, m.groups()[1:]):
                out[(m.group(1), d)] = float(value)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cubin")
    ap.add_argument("header")
    ap.add_argument("--nvdisasm")
    a = ap.parse_args()
    if a.nvdisasm and not shutil.which(a.nvdisasm):
        print(f"FAIL: --nvdisasm {a.nvdisasm}: not an executable")
        return 1
    tool = find_nvdisasm(a.nvdisasm)
    if not tool:
        print("SKIP: no nvdisasm (scripts/setup.sh --nvdisasm installs it from PyPI where nvcc is found)")
        return SKIP
    sass = subprocess.run([tool, "-c", a.cubin], capture_output=True, text=True, check=True).stdout
    want = budgets(a.header)
    if not want:
        print(f"FAIL: no 'sass budget' lines in {a.header}")
        return 1
    failures, seen = [], set()
    print(f"{'kernel':<16}{'D':>5}{'HMMA':>7}{'insns':>8}{'per HMMA':>10}{'budget':>8}   output")
    for name, insns, labels in functions(sass):
        k = KERNEL.search(name)
        if not k:
            continue
        kernel, d = k.group(1), int(k.group(2))
        out = "bf16" if "E13__nv_bfloat16EEv" in name else "fp32"
        loop = main_loop(insns, labels)
        if loop is None:
            failures.append(f"{kernel} D {d} ({out}): no loop with HMMA")
            continue
        ratio = loop[1] / loop[0]
        limit = want.get((kernel, d))
        seen.add((kernel, d))
        print(f"{kernel:<16}{d:>5}{loop[0]:>7}{loop[1]:>8}{ratio:>10.2f}"
              f"{limit if limit is not None else '-':>8}   {out}")
        if limit is None:
            failures.append(f"{kernel} D {d}: no budget line in {a.header}")
        elif ratio > limit:
            failures.append(f"{kernel} D {d} ({out}): {ratio:.2f} instructions per HMMA > budget {limit}")
    for key in sorted(set(want) - seen):
        failures.append(f"{key[0]} D {key[1]}: a budget but no such kernel in {a.cubin}")
    for f in failures:
        print("FAIL:", f)
    print("PASS" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
