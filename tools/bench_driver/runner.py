"""Running the programs: a command with its log and timeout, the configs of the sweep and their
flags, and the Driver that runs every stage, point and micro-benchmark.
"""
import datetime
import json
import os
import pathlib
import re
import shlex
import subprocess

from .config import (CP_STAGE, DEFAULTS, MESH_STAGES, PP_DEGREES, PP_SIZES, PP_STAGE,
                     REFERENCE_STAGE, ROOT, BenchError, rel, size_text, sizes, split_label,
                     stage_label)
from .arithmetic import (cp_plan, divides, pp_plan, summarise_attention, summarise_point,
                         summarise_pp)
from .microbench import parse_collectives, parse_gemm


def run(cmd, log, timeout):
    """Runs cmd with its output into log; returns (exit status, last line of output)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout)
        out, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (
            e.stdout or "")
        out += f"\n(killed after {timeout} s)"
        rc = 124
    except OSError as e:
        out, rc = str(e), 127
    log.write_text(out)
    # The program's own last error line, not mpirun's boilerplate about it.
    lines = [ln.strip() for ln in out.splitlines()
             if ln.strip() and not re.fullmatch(r"-+", ln.strip())]
    lines = [ln for ln in lines if not re.search(r"mpirun|Primary job|non-zero|Process name|"
                                                 r"Exit code|Per user-direction", ln)]
    errors = [ln for ln in lines if re.search(r"error|wrong|fail|killed", ln, re.I)]
    return rc, (errors[-1] if errors else lines[-1] if lines else f"exit status {rc}")


def trace_path(json_path):
    """Where a run's --trace goes: beside its --json, X.json -> X.trace.json."""
    return json_path.parent / (json_path.name.removesuffix(".json") + ".trace.json")


def config_flags(config):
    """The flags that give a stage the config: its sizes, or --model / --config as given."""
    flags = list(config.get("flags", []))
    for key in ("hidden", "heads", "ffn", "seq", "batch", "layers"):
        if key in config.get("set", {}):
            flags += [f"--{key}", str(config["set"][key])]
    return flags


def configs_for(device, quick, model=None, config_file=None):
    """The sweep's configs: the default and a GEMM-dominated one (H and F large against S), or
    the one --model / --config names (its sizes are the stage's to resolve: "flags")."""
    if model:
        return [{"name": model, "set": {}, "flags": ["--model", model], "optional": False,
                 "why": f"the `--model {model}` preset"}]
    if config_file:
        return [{"name": pathlib.Path(config_file).stem, "set": {},
                 "flags": ["--config", str(config_file)], "optional": False,
                 "why": f"the config file `{config_file}`"}]
    default = {"name": "default", "set": {}, "optional": False,
               "why": "the tutorial's default config"}
    if quick:  # the driver's own test: every step of the sweep on a config that runs in moments
        return [{"name": "small", "optional": False,
                 "set": {"hidden": 64, "heads": 4, "ffn": 128, "seq": 32, "batch": 2,
                         "layers": 2},
                 "why": "quick mode: a small config, enough to run every part of the sweep"}]
    if device == "cpu":
        big = [{"name": "gemm-heavy", "optional": False,
                "set": {"hidden": 512, "heads": 8, "ffn": 2048, "seq": 64, "batch": 2,
                        "layers": 1},
                "why": "H and F large against S: the GEMMs dominate the step"}]
    else:
        big = [{"name": "llama-7b", "optional": False,
                "set": {"hidden": 4096, "heads": 32, "ffn": 11008, "seq": 2048, "batch": 1,
                        "layers": 1},
                "why": "a Llama-7B-sized layer: the GEMMs dominate the step"},
               {"name": "llama-70b", "optional": True,
                "set": {"hidden": 8192, "heads": 64, "ffn": 28672, "seq": 2048, "batch": 1,
                        "layers": 1},
                "why": "a Llama-3-70B-sized layer (run where its memory fits)"}]
    return [default] + big


class Driver:
    def __init__(self, a):
        self.a = a
        self.build = pathlib.Path(a.build)
        self.bin = self.build / "bin"
        self.out = pathlib.Path(a.out)
        self.work = pathlib.Path(a.work) / a.device
        self.mpirun = shlex.split(a.mpirun)
        self.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        self.steps = 3 if a.quick else 8
        self.ranks = a.ranks or ([1, 2] if a.quick else [1, 2, 4])
        self.repeats = 1 if a.quick else a.repeats
        self.configs = configs_for(a.device, a.quick, a.model, a.config)
        self.notes = []  # lines for the section's notes

    def exe(self, name):
        p = self.bin / name
        return p if p.is_file() and os.access(p, os.X_OK) else None

    def stage_cmd(self, stage, n, config, json_path):
        exe, flag, degree = split_label(stage)  # "07_fsdp_tp D2": the mesh stage at D = 2
        cmd = self.mpirun + ["-np", str(n), str(self.bin / exe), "--device", self.a.device,
                             "--steps", str(self.steps)] + config_flags(config)
        if flag:
            cmd += [flag, degree]
        if self.a.device == "cuda" and stage != "06_fp8":
            cmd += ["--dtype", "bf16"]  # 06 keeps its default, fp8
        return cmd + ["--json", str(json_path)]

    # -- the stage sweep ----------------------------------------------------------------------
    def sweep(self, chosen):
        """The stage tables: the stages `chosen` (stage 08 has its own sweep, cp_sweep)."""
        stages = [s for s in chosen if self.exe(s)]
        if not stages:
            raise BenchError(f"no stage executables in {self.bin} (build first: scripts/bench.sh)")
        if self.a.stages and len(stages) < len(chosen):
            missing = [s for s in chosen if s not in stages]
            raise BenchError(f"not built in {self.bin}: {', '.join(missing)}")
        points, skipped = [], []
        for config in self.configs:
            known = "flags" not in config  # a preset's sizes are the stage's to check
            for stage in stages:
                if stage in MESH_STAGES:
                    letter, _, _, mesh_points = MESH_STAGES[stage]
                    for n, x in mesh_points:
                        if n not in self.ranks:
                            continue
                        z = sizes(config)
                        # D splits the batch; C cuts the sequence into 2C chunks split over TP.
                        bad = (z["batch"] % x if letter == "D"
                               else z["seq"] % (2 * n) or z["heads"] % (n // x))
                        if known and (not divides(z, n // x) or bad):
                            skipped.append(f"{config['name']} at {letter} {x} × TP {n // x}: "
                                           f"{size_text(z)} does not split")
                            continue
                        points.append((config, stage_label(stage, x), n))
                    continue
                for n in self.ranks:
                    if stage == "01_baseline" and n > 1:
                        continue
                    if known and not divides(sizes(config), n):
                        skipped.append(f"{config['name']} at N={n}: {size_text(sizes(config))} "
                                       f"does not split by {n}")
                        continue
                    points.append((config, stage, n))
        results = {}  # (config name, stage, n) -> [summaries]
        refused = {}  # optional config name -> the stage's one-line refusal
        declined = set()  # (config, stage, n) a stage refused under --model / --config
        total = len(points) * self.repeats
        done = 0
        for rep in range(self.repeats):  # repeats outermost: drift spreads over every point
            for config, stage, n in points:
                done += 1
                if config["name"] in refused:
                    continue
                name = stage.replace(" ", "-")  # "07_fsdp_tp-D2"
                path = self.work / "runs" / f"{config['name']}.{name}.np{n}.r{rep}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                cmd = self.stage_cmd(stage, n, config, path)
                print(f"[{done}/{total}] {config['name']} {stage} N={n} (repeat {rep + 1})",
                      flush=True)
                rc, last = run(cmd, path.with_suffix(".log"), self.a.timeout)
                if rc == 2 and config["optional"]:  # e.g. the memory estimate does not fit
                    refused[config["name"]] = f"{stage} at N={n}: {last}"
                    continue
                if rc == 2 and "flags" in config:  # the stage refuses the preset at this N
                    if (config["name"], stage, n) not in declined:
                        declined.add((config["name"], stage, n))
                        skipped.append(f"{config['name']} {stage} at N={n}: {last}")
                    continue
                if rc != 0:
                    raise BenchError(f"stage run failed (exit {rc}): {shlex.join(cmd)}\n  {last}\n"
                                     f"  full output: {path.with_suffix('.log')}")
                results.setdefault((config["name"], stage, n), []).append(
                    json.loads(path.read_text()))
        rows = []
        labels = [lab for s in stages
                  for lab in ([stage_label(s, x) for x in sorted({x for _, x in MESH_STAGES[s][3]})]
                              if s in MESH_STAGES else [s])]
        for config in self.configs:
            if config["name"] in refused:
                continue
            for stage in labels:
                for n in self.ranks:
                    runs = results.get((config["name"], stage, n))
                    if not runs:
                        continue
                    r = summarise_point(runs)
                    r.update(config=config["name"], steps=self.steps)
                    r["spread"] = f"{r['step_ms_min']:.2f}–{r['step_ms_max']:.2f}"
                    rows.append(r)
        expected = [(c["name"], s, n) for c, s, n in points
                    if c["name"] not in refused and (c["name"], s, n) not in declined]
        return stages, rows, expected, skipped, refused

    def cp_config(self, seq):
        return {"name": f"S{seq}", "set": {"seq": seq}, "optional": False,
                "why": ("the tutorial's default config" if seq == DEFAULTS["seq"] else
                        f"the default config with a {seq // DEFAULTS['seq']}× longer sequence")}

    def cp_sweep(self):
        """Stage 08's subsection (cp_plan), every run with --trace; a point whose stage refuses
        it (exit 2, e.g. --cp > 1 on cuda) is left out with its line. Returns (table rows,
        attention rows, expected table points, expected attention points, left-out lines)."""
        missing = [s for s in (REFERENCE_STAGE, CP_STAGE) if not self.exe(s)]
        if missing:
            raise BenchError(f"not built in {self.bin}: {', '.join(missing)}")
        table, attention = cp_plan(self.ranks, self.a.quick, self.a.device)
        runs = list(dict.fromkeys(table + [(seq, stage_label(CP_STAGE, c), c)
                                           for seq, c in attention]))

        def command(point, json_path):
            seq, stage, n = point
            return (self.stage_cmd(stage, n, self.cp_config(seq), json_path) +
                    ["--trace", str(trace_path(json_path))])

        results, refused = self.run_points(
            "cp", runs, lambda pt: f"S{pt[0]}.{pt[1].replace(' ', '-')}.np{pt[2]}",
            lambda pt: f"S={pt[0]} {pt[1]} N={pt[2]}", command, traced=True)
        rows = []
        for seq, stage, n in table:
            if (seq, stage, n) not in results:
                continue
            r = summarise_point([s for s, _ in results[(seq, stage, n)]])
            _, _, degree = split_label(stage)
            c = int(degree) if degree else 1  # stage 03: no CP, T = N
            r.update(config=f"S{seq}", steps=self.steps, c=c, t=n // c,
                     spread=f"{r['step_ms_min']:.2f}–{r['step_ms_max']:.2f}")
            rows.append(r)
        att = [summarise_attention(seq, c, results[(seq, stage_label(CP_STAGE, c), c)])
               for seq, c in attention if (seq, stage_label(CP_STAGE, c), c) in results]
        for r in att:
            r["steps"] = self.steps
        left_out = [f"S={seq} {stage} at N={n}: {line}"
                    for (seq, stage, n), line in refused.items()]
        return (rows, att, [(f"S{s}", st, n) for s, st, n in table if (s, st, n) not in refused],
                [(s, c) for s, c in attention if (s, stage_label(CP_STAGE, c), c) not in refused],
                left_out)

    def run_points(self, part, points, name, title, command, traced=False):
        """Runs a subsection's points R times, repeats outermost (drift spreads over every
        point), each with --json (and, `traced`, --trace beside it) under WORK/<part>/; a point
        whose stage refuses it (exit 2) is left out after its first refusal, any other failure
        stops the driver. name(point): the files' name, title(point): the progress line's,
        command(point, json path): the command. Returns ({point: [(summary, trace or None) per
        run]}, {point: its one-line refusal})."""
        results, refused = {}, {}
        total, done = len(points) * self.repeats, 0
        for rep in range(self.repeats):
            for point in points:
                done += 1
                if point in refused:
                    continue
                base = self.work / part / f"{name(point)}.r{rep}"
                base.parent.mkdir(parents=True, exist_ok=True)
                json_path = base.parent / (base.name + ".json")
                cmd = command(point, json_path)
                print(f"[{part} {done}/{total}] {title(point)} (repeat {rep + 1})", flush=True)
                log = base.parent / (base.name + ".log")
                rc, last = run(cmd, log, self.a.timeout)
                if rc == 2:
                    refused[point] = last
                    continue
                if rc != 0:
                    raise BenchError(f"stage run failed (exit {rc}): {shlex.join(cmd)}\n  {last}\n"
                                     f"  full output: {log}")
                trace = json.loads(trace_path(json_path).read_text()) if traced else None
                results.setdefault(point, []).append((json.loads(json_path.read_text()), trace))
        return results, refused

    def pp_config(self):
        return {"name": "pp", "set": PP_SIZES[self.a.quick], "optional": False,
                "why": "small sizes: the pipeline's mechanics in seconds per run"}

    def pp_cmd(self, point, json_path):
        """A point of stage 09's sweep: N = P ranks, T = D = C = 1."""
        schedule, p, v, m = point
        return self.stage_cmd(PP_STAGE, p, self.pp_config(), json_path) + [
            "--pp", str(p), "--schedule", schedule, "--stages-per-rank", str(v),
            "--microbatches", str(m)]

    def pp_sweep(self):
        """Stage 09's subsection (pp_plan); a point the stage refuses (exit 2) is left out with
        its line. Returns (rows, expected points, left-out lines)."""
        if not self.exe(PP_STAGE):
            raise BenchError(f"not built in {self.bin}: {PP_STAGE}")
        points = pp_plan(self.ranks, self.a.quick)
        if not points:
            raise BenchError(f"{PP_STAGE}'s sweep runs at N = P = "
                             f"{' or '.join(map(str, PP_DEGREES))}: --ranks has neither")
        results, refused = self.run_points(
            "pp", points, lambda pt: f"{pt[0]}.P{pt[1]}.V{pt[2]}.M{pt[3]}",
            lambda pt: f"{pt[0]} P={pt[1]} V={pt[2]} M={pt[3]}", self.pp_cmd)
        rows = [dict(summarise_pp(pt, [s for s, _ in results[pt]]), steps=self.steps)
                for pt in points if pt in results]
        left_out = [f"{s} P={p} V={v} M={m}: {line}" for (s, p, v, m), line in refused.items()]
        return rows, [pt for pt in points if pt not in refused], left_out

    # -- micro-benchmarks ---------------------------------------------------------------------
    def bench_gemm(self):
        """Runs bench_gemm; returns (rows, chunked rows, the command, a note if it could not)."""
        exe = self.exe("bench_gemm")
        if not exe:
            return None, None, None, f"`bench_gemm` is not in {rel(self.bin)} (not built)."
        path = self.work / "bench_gemm.json"
        cmd = [str(exe), f"--benchmark_filter=^gemm(_chunked)?/{self.a.device}/",
               f"--benchmark_out={path}", "--benchmark_out_format=json"]
        if self.a.device == "cpu":  # Google Benchmark's default of 0.5 s per row is not needed
            cmd.append(f"--benchmark_min_time={0.01 if self.a.quick else 0.2}")
        print("bench_gemm ...", flush=True)
        rc, last = run(cmd, path.with_suffix(".log"), self.a.timeout)
        if rc != 0 or not path.is_file():
            return None, None, cmd, f"`bench_gemm` failed (exit {rc}): {last}"
        gemm, chunked = parse_gemm(json.loads(path.read_text()), self.a.device)
        return gemm, chunked, cmd, None

    def bench_collectives(self):
        """Runs bench_collectives at N = 2 (and 4); returns [(n, rows, cmd, note)]."""
        exe = self.exe("bench_collectives")
        if not exe:
            return [(None, None, None, f"`bench_collectives` is not in {rel(self.bin)} "
                     "(not built).")]
        max_bytes = "64K" if self.a.quick else ("16M" if self.a.device == "cpu" else "1G")
        out = []
        for n in [2] if self.a.quick else [2, 4]:
            path = self.work / f"bench_collectives.np{n}.json"
            path.unlink(missing_ok=True)
            cmd = self.mpirun + ["-np", str(n), str(exe), "--max-bytes", max_bytes,
                                 f"--benchmark_filter=^collective/[^/]+/{self.a.device}/",
                                 f"--benchmark_out={path}", "--benchmark_out_format=json"]
            print(f"bench_collectives N={n} ...", flush=True)
            rc, last = run(cmd, path.with_suffix(".log"), self.a.timeout)
            rows = None
            if path.is_file():
                try:
                    rows = parse_collectives(json.loads(path.read_text()))
                except (ValueError, KeyError) as e:
                    last = f"unreadable output: {e}"
            note = None if rc == 0 else f"`bench_collectives` at N={n} failed (exit {rc}): {last}"
            out.append((n, rows, cmd, note))
        return out

    def projection(self):
        """Runs tpx_project; returns (its markdown, the command, a note if it could not)."""
        exe = self.exe("tpx_project")
        if not exe:
            return None, None, f"`tpx_project` is not in {rel(self.bin)} (not built)."
        md, js = self.work / "projection.md", self.work / "projection.json"
        md.unlink(missing_ok=True)
        cmd = [str(exe), "--device", str(ROOT / "tools/devices/h100_sxm.json"), "--markdown",
               str(md), "--json", str(js)] + self.configs[0].get("flags", [])
        print("tpx_project ...", flush=True)
        rc, last = run(cmd, self.work / "projection.log", self.a.timeout)
        if rc != 0 or not md.is_file():
            return None, cmd, f"`tpx_project` failed (exit {rc}): {last}"
        return md.read_text(), cmd, None
