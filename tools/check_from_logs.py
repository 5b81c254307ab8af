#!/usr/bin/env python3
"""Fails when docs/benchmarks.md's CUDA section or its CSVs (docs/benchmarks/cuda_run*.csv) are
not what `scripts/bench.sh --from-logs RUN [--from-logs RUN2 …]` writes now from the runs' logs,
or when the device file's measured block is not what the H100 run's logs give: the published page
cannot drift from its logs. Run by ctest (docs.from_logs); writes into a temporary folder only.

    tools/check_from_logs.py [RUN …]     (default: the runs of RUNS, newest first)
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
# The runs the CUDA section shows, newest first, and the one whose measurements the projection's
# device file (tools/devices/h100_sxm.json) holds: an H100's, the projection's GPU.
RUNS = ["docs/gpu-runs/2026-11-27-h200", "docs/gpu-runs/2026-11-27-h100"]
DEVICE_RUN = "docs/gpu-runs/2026-11-27-h100"


def differences(name, want, have):
    diff = list(difflib.unified_diff(have.splitlines(), want.splitlines(), f"committed {name}",
                                     f"{name} from the logs", lineterm="", n=1))
    return diff[:40] + (["…"] if len(diff) > 40 else [])


def main(argv):
    runs = argv or RUNS
    command = "scripts/bench.sh " + " ".join(f"--from-logs {r}" for r in runs)
    docs = ROOT / "docs"
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        shutil.copy(docs / "benchmarks.md", out / "benchmarks.md")
        args = [a for r in runs for a in ("--from-logs", str(ROOT / r))]
        rc = bench.main(args + ["--out", str(out), "--command", command])
        if rc != 0:
            print(f"check_from_logs: {command} failed (exit {rc})", file=sys.stderr)
            return 1
        committed = (docs / "benchmarks.md").read_text()
        fresh = (out / "benchmarks.md").read_text()
        pairs = [("the CUDA section of docs/benchmarks.md", bench.section_body(fresh, "cuda"),
                  bench.section_body(committed, "cuda"))]
        for i, r in enumerate(runs):
            csv_path, _ = bench.from_logs_outputs(out, pathlib.Path(r), i == 0)
            mine = docs / "benchmarks" / csv_path.name
            pairs.append((f"docs/benchmarks/{csv_path.name}", csv_path.read_text(),
                          mine.read_text() if mine.is_file() else ""))
        for name, want, have in pairs:
            if want != have:
                problems.append(f"{name} is not what {', '.join(runs)} give:")
                problems += ["  " + line for line in differences(name, want, have)]
    try:
        problems += gpu_logs.check_device_file(ROOT / "tools/devices/h100_sxm.json",
                                               gpu_logs.load_run(ROOT / DEVICE_RUN), DEVICE_RUN)
    except gpu_logs.LogError as e:
        problems.append(str(e))
    for p in problems:
        print(f"check_from_logs: {p}", file=sys.stderr)
    if problems:
        print(f"check_from_logs: regenerate with `{command}` (and `tools/gpu_logs.py "
              f"--device-file tools/devices/h100_sxm.json {DEVICE_RUN} --write`)",
              file=sys.stderr)
        return 1
    print(f"the CUDA section and its CSVs are what {', '.join(runs)} give, and h100_sxm.json's "
          f"measured block what {DEVICE_RUN} gives")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main(sys.argv[1:]))
