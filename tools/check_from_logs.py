#!/usr/bin/env python3
"""Fails when docs/benchmarks.md's CUDA section or docs/benchmarks/cuda_run.csv is not what
`scripts/bench.sh --from-logs RUN` writes now from the run's logs, or when the device file's
measured block is not what those logs give: the published page cannot drift from its logs.
Run by ctest (docs.from_logs); writes into a temporary folder only.

    tools/check_from_logs.py [RUN]     (default: docs/gpu-runs/2026-11-27-h100)
"""
import difflib
import os
import pathlib
import shutil
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench  # noqa: E402
import gpu_logs  # noqa: E402

ROOT = bench.ROOT
DEFAULT_RUN = "docs/gpu-runs/2026-11-27-h100"


def differences(name, want, have):
    diff = list(difflib.unified_diff(have.splitlines(), want.splitlines(), f"committed {name}",
                                     f"{name} from the logs", lineterm="", n=1))
    return diff[:40] + (["…"] if len(diff) > 40 else [])


def main(argv):
    run = argv[0] if argv else DEFAULT_RUN
    docs = ROOT / "docs"
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        shutil.copy(docs / "benchmarks.md", out / "benchmarks.md")
        rc = bench.main(["--from-logs", str(ROOT / run), "--out", str(out),
                         "--command", f"scripts/bench.sh --from-logs {run}"])
        if rc != 0:
            print(f"check_from_logs: tools/bench.py --from-logs {run} failed (exit {rc})",
                  file=sys.stderr)
            return 1
        committed = (docs / "benchmarks.md").read_text()
        fresh = (out / "benchmarks.md").read_text()
        for name, want, have in [
                ("the CUDA section of docs/benchmarks.md", bench.section_body(fresh, "cuda"),
                 bench.section_body(committed, "cuda")),
                ("docs/benchmarks/cuda_run.csv", (out / "benchmarks" / "cuda_run.csv").read_text(),
                 (docs / "benchmarks" / "cuda_run.csv").read_text()
                 if (docs / "benchmarks" / "cuda_run.csv").is_file() else "")]:
            if want != have:
                problems.append(f"{name} is not what {run}'s logs give:")
                problems += ["  " + line for line in differences(name, want, have)]
    try:
        problems += gpu_logs.check_device_file(ROOT / "tools/devices/h100_sxm.json",
                                               gpu_logs.load_run(ROOT / run), run)
    except gpu_logs.LogError as e:
        problems.append(str(e))
    for p in problems:
        print(f"check_from_logs: {p}", file=sys.stderr)
    if problems:
        print(f"check_from_logs: regenerate with `scripts/bench.sh --from-logs {run}` (and "
              f"`tools/gpu_logs.py --device-file tools/devices/h100_sxm.json {run} --write`)",
              file=sys.stderr)
        return 1
    print(f"the CUDA section, cuda_run.csv and h100_sxm.json's measured block are what {run} "
          "gives")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main(sys.argv[1:]))
