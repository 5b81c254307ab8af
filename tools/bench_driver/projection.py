"""The projection section (tools/tpx_project) and its check against the latest published GPU run's
measured step times.
"""
import json
import os

from .config import ROOT, BenchError
from .tables import md_table
from .page import benchmarks_md, replace_section, show
from .runner import run


GPU_RUNS = ROOT / "docs" / "gpu-runs"  # published GPU runs, one folder each (DATE-GPU)
GPU_DEVICE_FILE = ROOT / "tools" / "devices" / "h100_sxm.json"  # the projection's, and the run's
# The projection's views of the one measured step: (tpx_project flags, what it models, the
# measured step it is compared with: tpx's own, or PyTorch's on the same GPU).
MEASURED_CHECK = [
    (["--assumed"], "the device file's assumptions alone (GEMM efficiency up to 0.78 of the "
                    "datasheet peak, attention at 0.5 of it): the model as it was before the run",
     "tpx"),
    (["--attention", "fused"], "measured GEMMs, tpx's fused attention as measured: tpx as it is",
     "tpx"),
    (["--attention", "sdpa"], "measured GEMMs, PyTorch SDPA's attention as measured: what a "
                              "FlashAttention-class kernel would give", "torch"),
]


def error_line(projected_ms, measured_ms):
    """'−9.2 %' within a factor of 2, else '4.7× too fast' / '2.1× too slow'."""
    ratio = projected_ms / measured_ms
    if 0.5 <= ratio <= 2:
        return f"{(ratio - 1) * 100:+.1f} %"
    return f"{1 / ratio:.1f}× too fast" if ratio < 1 else f"{ratio:.1f}× too slow"


def latest_gpu_run(runs=GPU_RUNS, gpu="H100"):
    """The newest published run folder on a `gpu` (the projection's device: its reports' device
    name holds the word) that has a big stage 01 log, or None."""
    import gpu_logs

    def on_gpu(p):
        f = gpu_logs.files_of(p)
        try:
            return f["big"].is_file() and gpu in gpu_logs.report_md(f["report"])["device"]
        except gpu_logs.LogError:
            return False
    found = sorted(p for p in runs.glob("*") if p.is_dir() and on_gpu(p))
    return found[-1] if found else None


def measured_check(exe, device_file, work, timeout, run_dir=None):
    """The projection against the one measured GPU step (stage 01 at the big log's shape): lines
    of markdown, projected by `exe` in each MEASURED_CHECK view; [] without a published run."""
    import gpu_logs
    run_dir = run_dir or latest_gpu_run()
    if run_dir is None:
        return []
    f = gpu_logs.files_of(run_dir)
    try:
        big = gpu_logs.stage_log(f["big"])
        report = gpu_logs.report_md(f["report"])
        commit = gpu_logs.readme_commit(f["readme"])
        torch = gpu_logs.torch_log(f["torch"])
    except gpu_logs.LogError as e:
        raise BenchError(str(e))
    s = big["sizes"]
    flags = ["--hidden", s["hidden"], "--heads", s["heads"], "--kv-heads", s["kv_heads"],
             "--ffn", s["ffn"], "--seq", s["seq"], "--batch", s["batch"], "--layers", s["layers"],
             "--dtype", big["dtype"], "--tp", 1]
    rows = []
    for i, (view, what, against) in enumerate(MEASURED_CHECK):
        js = work / f"measured_check.{i}.json"
        js.unlink(missing_ok=True)
        cmd = [str(exe), "--device", str(device_file)] + view + [str(f) for f in flags] + [
            "--json", str(js)]
        rc, last = run(cmd, work / f"measured_check.{i}.log", timeout)
        if rc != 0 or not js.is_file():
            raise BenchError(f"`{show(cmd)}` failed (exit {rc}): {last}")
        stage = next((r for r in json.loads(js.read_text())["stages"]
                      if r["stage"] == big["stage"]), None)
        if stage is None:
            raise BenchError(f"{js}: no {big['stage']} row")
        ms = stage["step_ms"]
        measured = ([("tpx", big["step_ms"])] if against == "tpx" else
                    [("PyTorch eager", torch["eager"]["step_ms"]),
                     ("torch.compile", torch["compile"]["step_ms"])])
        rows.append([what, "`" + " ".join(view) + "`", f"{ms:.2f}",
                     ", ".join(f"{who} {m:.2f}" for who, m in measured),
                     ", ".join(f"{error_line(ms, m)}" + (f" vs {who}" if len(measured) > 1
                                                         else "") for who, m in measured)])
    log = os.path.relpath(f["big"], ROOT / "docs")
    shape = " ".join(f"{k} {s[v]}" for k, v in (("H", "hidden"), ("NH", "heads"), ("F", "ffn"),
                                                 ("S", "seq"), ("B", "batch"), ("L", "layers")))
    return [f"**First, the model against the one measured GPU step**: {big['stage']}, "
            f"{big['dtype']}, {shape}, one training step on one {big['device']['name']} "
            f"({report['date']}, commit `{commit}`, [its log]({log})): measured "
            f"{big['step_ms']:.2f} ms (PyTorch on the same GPU and block: eager "
            f"{torch['eager']['step_ms']:.2f} ms, torch.compile {torch['compile']['step_ms']:.2f} "
            "ms). The model's constants were not chosen against this step "
            "(the GEMM and attention rates come from the micro-benchmarks of the same run), so it "
            "is held out. Until a projection is within a few per cent of a measured step, do not "
            "trust the TP rows below for more than their order.", ""] + md_table(
        ["what the model uses", "tpx_project flags", "projected ms", "measured ms (same GPU)",
         "error"],
        rows).split("\n") + ["", "The tables below use the device file's default: measured GEMMs and "
                 "SDPA-class attention (what the stages' schemes would cost with a fast attention "
                 "kernel; on that run tpx's own fused kernel was about 40× slower than SDPA; the "
                 "CUDA section has the later runs).", ""]


def projection_section(a, d, projection, proj_cmd, proj_note, check=()):
    proj = ["## Projection (H100 SXM, projected)", ""]
    if projection is None:
        return proj + [proj_note]
    return proj + list(check) + [
        "Projected by the model, not measured. Date: " + d.date + ". Command: `"
        + show(proj_cmd) + "` (run by `" + a.command + "`); its markdown, verbatim:", "",
        projection.strip()]


def drive_projection(a, d, out):
    """--only projection: tpx_project alone, its section of benchmarks.md replaced."""
    projection, proj_cmd, proj_note = d.projection()
    if projection is None:
        raise BenchError(proj_note)
    check = measured_check(d.exe("tpx_project"), GPU_DEVICE_FILE, d.work, a.timeout)
    md = out / "benchmarks.md"
    text = benchmarks_md(md)
    text = replace_section(text, "projection", "\n".join(
        projection_section(a, d, projection, proj_cmd, proj_note, check)))
    md.write_text(text.rstrip("\n") + "\n")
    print(f"wrote the projection section of {md}")
    return 0
