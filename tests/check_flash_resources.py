#!/usr/bin/env python3
"""The fused-attention kernels' resources, from ptxas's report (nvcc -Xptxas -v, one file per
architecture) and the launchers' dynamic shared memory (flash_tc_smem's lines): registers,
spills, shared bytes, and the blocks that fit on one SM. Fails when an mma.sync kernel
(flash_*_mma, every instance: bf16 and fp32 outputs, D = 32, 64, 128) spills, fits fewer than
two blocks per SM on sm_90, or is missing from a report; prints the CUDA-core kernels' numbers
(their spills included) without failing on them.

usage: check_flash_resources.py SMEM_LINES REPORT_sm_90 [REPORT_sm_80 ...]
"""
import re
import shutil
import subprocess
import sys

# Per SM: registers, shared bytes usable by blocks, shared bytes reserved per block, largest
# shared bytes per block, threads, blocks (CUDA C++ Programming Guide, compute capabilities).
ARCH = {
    "sm_90": dict(regs=65536, smem=228 * 1024, reserved=1024, per_block=227 * 1024, threads=2048, blocks=32),
    "sm_80": dict(regs=65536, smem=164 * 1024, reserved=1024, per_block=163 * 1024, threads=2048, blocks=32),
}
REG_UNIT = 256  # registers are allocated per warp in units of 256


def demangle(names):
    tool = shutil.which("c++filt")
    if not tool or not names:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout
    return out.splitlines()


def parse(path):
    """{kernel: (registers, spill stores, spill loads, static smem)} of one ptxas report."""
    text = open(path).read()
    entries = []
    for chunk in text.split("Compiling entry function '")[1:]:
        name, arch = re.match(r"(\S+)' for '(sm_\d+)'", chunk).groups()
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", chunk)
        regs = re.search(r"Used (\d+) registers", chunk)
        smem = re.search(r"(\d+) bytes smem", chunk)  # absent when the kernel has none static
        if not (spills and regs):
            sys.exit(f"{path}: no resource lines for {name}")
        entries.append((name, arch, 0, spills.group(1), spills.group(2), regs.group(1),
                        smem.group(1) if smem else "0"))
    if not entries:
        sys.exit(f"{path}: no kernel found in the ptxas report")
    names = demangle([e[0] for e in entries])
    out = {}
    for name, e in zip(names, entries):
        m = re.search(r"(flash_\w+?)(<[^>]*>)?\(", name)
        if not m:
            continue
        short = (m.group(1) + (m.group(2) or "")).replace(" ", "").replace("__nv_bfloat16", "bf16")
        out[short] = dict(arch=e[1], regs=int(e[5]), spill_st=int(e[3]), spill_ld=int(e[4]),
                          smem=int(e[6]))
    return out


def blocks_per_sm(a, threads, regs, smem):
    warps = (threads + 31) // 32
    per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    by_regs = a["regs"] // (per_warp * warps) if regs else a["blocks"]
    total = smem + a["reserved"]
    by_smem = a["smem"] // total if smem <= a["per_block"] else 0
    return min(by_regs, by_smem, a["threads"] // threads, a["blocks"]), by_regs, by_smem


def main():
    launch = {}
    for line in open(sys.argv[1]):
        name, threads, smem = line.split()
        launch[name] = (int(threads), int(smem))
    failures = []
    for path in sys.argv[2:]:
        kernels = parse(path)
        arch_name = next(iter(kernels.values()))["arch"] if kernels else "?"
        # Every tensor-core instance the launchers can start must have been compiled and checked.
        for name in sorted(n for n in launch if "_mma" in n and n not in kernels):
            failures.append(f"{arch_name} {name}: not in {path}")
        for name in sorted(kernels):
            k = kernels[name]
            arch = ARCH[k["arch"]]
            base = name.split("<")[0]
            key = name if name in launch else next(
                (n for n in launch if n.split("<")[0] == base and name.startswith(n[:-1])), None)
            if key is None:
                failures.append(f"{name}: no launch shape in {sys.argv[1]}")
                continue
            threads, dyn = launch[key]
            smem = k["smem"] + dyn
            blocks, by_regs, by_smem = blocks_per_sm(arch, threads, k["regs"], smem)
            new = "_mma" in base
            print(f"{k['arch']} {name:40s} threads {threads:3d} regs {k['regs']:3d} "
                  f"spills {k['spill_st']}/{k['spill_ld']} B  smem {smem:6d} B  "
                  f"blocks/SM {blocks} (regs {by_regs}, smem {by_smem})"
                  + ("" if new else "  [CUDA cores: reported only]"))
            if new and (k["spill_st"] or k["spill_ld"]):
                failures.append(f"{k['arch']} {name}: spills {k['spill_st']} B stores, "
                                f"{k['spill_ld']} B loads")
            if new and k["arch"] == "sm_90" and blocks < 2:
                failures.append(f"sm_90 {name}: {blocks} block(s) per SM, fewer than 2")
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
