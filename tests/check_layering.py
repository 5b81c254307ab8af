#!/usr/bin/env python3
"""common/ knows no particular stage: what a stage adds (its flags, its stats, its memory terms,
its bytes formula) reaches the shared code through the stage's own registration, never through
common/ naming it (docs/README.md, "Each stage's one idea"). Fails, naming file and line, when
a file under common/
  - includes a header of a stage's folder (#include "0N_...");
  - branches on a stage's number (stage == 6, case 5: on a stage variable, info.fp8, ...);
  - links a stage's library in its CMakeLists.txt (tpx_megatron, tpx_fsdp_tp, ...).
Comments and string literals do not count: naming the stages that use a piece is documentation.

usage: check_layering.py [ROOT]      (ROOT: the repository, default: this file's parent's parent)
       check_layering.py --self-test (plants each violation in a scratch tree and expects it found)
"""
import pathlib
import re
import sys
import tempfile

SOURCES = {".h", ".cc", ".cu", ".cuh"}
STAGE_LIBS = (
    "tpx_baseline", "tpx_megatron", "tpx_sequence_parallel", "tpx_overlap_ring",
    "tpx_copy_engine_async_tp", "tpx_fp8", "tpx_fsdp_tp", "tpx_fsdp_memory",
    "tpx_context_parallel", "tpx_cp_memory", "tpx_pipeline_parallel", "tpx_pipeline_memory",
    "tpx_schedules",
)
INCLUDE = re.compile(r'^\s*#\s*include\s+"0\d_')
STAGE_BRANCH = re.compile(
    r"\bstage\s*(==|!=|>=|<=|<|>)\s*\d|\b\d\s*(==|!=|>=|<=|<|>)\s*stage\b"
    r"|\bswitch\s*\(\s*stage\s*\)|\binfo\.(fp8|copy_engine|pipeline|context_parallel|mesh)\b"
)


def code_only(line, in_block):
    """The line without comments and string literals; and whether a /* */ comment is still open."""
    out, i = [], 0
    while i < len(line):
        if in_block:
            end = line.find("*/", i)
            if end < 0:
                return "".join(out), True
            i, in_block = end + 2, False
        elif line.startswith("//", i):
            break
        elif line.startswith("/*", i):
            in_block, i = True, i + 2
        elif line[i] in "\"'":
            quote, i = line[i], i + 1
            while i < len(line) and line[i] != quote:
                i += 2 if line[i] == "\\" else 1
            i += 1
            out.append(quote * 2)
        else:
            out.append(line[i])
            i += 1
    return "".join(out), in_block


def problems(root):
    common = pathlib.Path(root) / "common"
    found = []
    for path in sorted(common.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(root)
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
        if path.suffix in SOURCES:
            in_block = False
            for n, line in enumerate(text, 1):
                if INCLUDE.match(line):
                    found.append(f"{rel}:{n}: includes a stage's header: {line.strip()}")
                    continue
                code, in_block = code_only(line, in_block)
                if STAGE_BRANCH.search(code):
                    found.append(f"{rel}:{n}: branches on a particular stage: {line.strip()}")
        elif path.name == "CMakeLists.txt":
            for n, line in enumerate(text, 1):
                code = line.split("#", 1)[0]
                for lib in STAGE_LIBS:
                    if re.search(rf"\b{lib}\b", code):
                        found.append(f"{rel}:{n}: links stage library {lib}: {line.strip()}")
    return found


def self_test():
    planted = {
        "common/a.cc": '#include "05_copy_engine_async_tp/flags.h"\n',
        "common/b.cc": "int f(int stage) {\n  return stage == 6 ? 5 : stage;\n}\n",
        "common/c.h": "void g(const StageInfo& info) {\n  if (info.fp8) return;\n}\n",
        "common/d.cc": "Traffic t(int stage) {\n  switch (stage) {}\n}\n",
        "common/CMakeLists.txt": "target_link_libraries(tpx_common PUBLIC tpx_fsdp_tp)\n",
    }
    clean = {
        "common/e.cc": '// stage == 6 in a comment\nconst char* s = "stage == 6";\n/* stage\n== 6 */\n',
        "common/CMakeLists.txt.in": "tpx_fsdp_tp\n",
    }
    with tempfile.TemporaryDirectory() as tmp:
        for files in (planted, clean):
            for name, body in files.items():
                p = pathlib.Path(tmp) / name
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(body)
        found = problems(tmp)
    want = {name: False for name in planted}
    for line in found:
        name = line.split(":", 1)[0]
        if name in want:
            want[name] = True
        else:
            print(f"self-test: a clean file was reported: {line}")
            return False
    missed = [name for name, hit in want.items() if not hit]
    for name in missed:
        print(f"self-test: the violation planted in {name} was not found")
    return not missed


def main(argv):
    if argv[1:] == ["--self-test"]:
        ok = self_test()
        print("self-test:", "every planted violation found, no clean line reported" if ok else "FAILED")
        return 0 if ok else 1
    root = pathlib.Path(argv[1]) if len(argv) > 1 else pathlib.Path(__file__).resolve().parents[1]
    found = problems(root)
    for line in found:
        print(line)
    files = sum(1 for p in (root / "common").rglob("*") if p.suffix in SOURCES)
    print(f"common/: {files} source files, {len(found)} naming a particular stage")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
