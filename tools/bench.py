#!/usr/bin/env python3
"""The benchmark driver: runs every stage over a sweep of rank counts and configs with --json,
the micro-benchmarks and the projection, and writes docs/benchmarks.md (one section per device),
a CSV per device and SVG plots. Normally started by scripts/bench.sh, which builds first.

    tools/bench.py --build DIR [--device cpu|cuda] [--repeats R] [--quick] [--out DIR]
                   [--stages 04,05] [--ranks 2,4] [--model NAME | --config FILE]
                   [--work DIR] [--mpirun "mpirun --oversubscribe --bind-to none"]
                   [--command "what to print as the command that made the tables"]
    tools/bench.py --from-logs DIR [--from-logs DIR2 …] [--out DIR]

--from-logs DIR publishes a GPU run made elsewhere: the CUDA section, benchmarks/cuda_run.csv and
figures/bench_cuda_attention.svg written from the logs of a run folder (docs/gpu-runs/DATE-GPU,
as scripts/gpu-validate.sh and the profilers left them), parsed by tools/gpu_logs.py; nothing is
run, and a log that lacks a line the section needs stops it (exit 1, naming the file). Given
again (newest run first), the section keeps every run: a table of the runs side by side, then a
subsection per run, labelled with its GPU; an earlier run's CSV and figure carry its folder's
name (benchmarks/cuda_run.DATE-GPU.csv, figures/bench_cuda_attention.DATE-GPU.svg).

The sweep: N = 1, 2, 4 (stage 01 only at N = 1; an N that does not divide H, NH, F and S is left
out), the default config and a GEMM-dominated one, each point run R times. Stage 08 has its own
subsection (cp_plan): its meshes C × T = 2 × 1, 1 × 2, 2 × 2 at S = 128 and 512 beside stage 03 at
the same S and N, and attention time against S for C = 1, 2, 4 (T = 1), from the `attention fwd` /
`attention bwd` spans of every run's --trace (the same measure at every C; the stage's own
cp_attention_ms is 0 at C = 1, where stage 08 is stage 07) beside the ring steps alone. Stage 09
has its own subsection too (pp_plan): each schedule (gpipe, 1f1b, zb-h1 at V = 1,
interleaved-1f1b at V = 2) at P = 2 and 4 (N = P, T = D = C = 1) over M = 1, 2, 4, 8 on small
sizes, the --json's measured bubble beside the schedule's formula. A selection
narrows it: --stages (numbers or names, comma-separated), --ranks (comma-separated N), and --model
NAME or --config FILE, which replace the two configs by that one, forwarded as they are to every
stage and to tpx_project (a stage that refuses the config at some N, exit 2, leaves that point out
with its one line). With a selection the page goes under --work unless --out is given, so the
committed docs/benchmarks.md keeps the full sweep; its text says what ran either way. A point's step
time is the mean over the steps after step 0 (step 0 warms up) of one run; the tables give the
median over the R runs and their spread as min–max. From it, per rank:
    TFLOP/s        = flops_per_step_per_rank / step time            (GEMM FLOPs, common/flops.h)
    MFU            = TFLOP/s / peak, the peak MEASURED by bench_gemm (its largest bf16 GEMM on
                     cuda, fp32 on the cpu), never assumed
    comm bus GB/s  = comm_bus_bytes per step / step time             (10⁹ bytes per second)
    speed-up vs 03 = step time of stage 03 / step time of the stage  (same config and N)

Outputs under --out (default: the repository's docs/): benchmarks.md, whose sections between
`<!-- tpx-bench:begin NAME -->` and `<!-- tpx-bench:end NAME -->` are replaced one at a time
(a cpu run leaves the cuda section alone and vice versa; stage 08's subsection has its own
markers, `<device>-cp`, and --only cp replaces it alone; stage 09's likewise, `<device>-pp` and
--only pp), benchmarks/<device>.csv, benchmarks/<device>_cp.csv,
benchmarks/<device>_cp_attention.csv, benchmarks/<device>_pp.csv,
figures/bench_<device>_{step_ms,exposed_comm,breakdown}.svg,
figures/bench_<device>_cp_attention.svg and figures/bench_<device>_pp_bubble.svg. The raw --json
files and logs go under --work. A stage run that fails stops the driver (exit 1); a
micro-benchmark program that is missing or fails leaves a one-line note in its section instead
(collectives with wrong results are flagged in bold in the section and on stderr). Before it
exits the driver reads its outputs back and exits 1 if any expected file, row or cell is missing.

The environment is the caller's: under scripts/env.sh (OPENBLAS_NUM_THREADS=1, Open MPI's consent
to run as root and to oversubscribe). Plots need matplotlib (Debian: python3-matplotlib).

The code is the package tools/bench_driver/, one module per concern (its __init__ lists them);
this file is the entry point, and its names are the package's, as tools/test_bench.py and
tools/check_from_logs.py use them.
"""
import os  # noqa: F401  (bench.os: tools/test_bench.py reads the core count through it)
import sys

# The package's names, for the callers of this module (unused here but for main).
from bench_driver.config import (CP_ATTENTION_C, CP_ATTENTION_SEQS, CP_STAGE, CP_TABLE_SEQS,
                                 DEFAULTS, MESH_STAGES, MIB, PP_DEGREES, PP_MICROBATCHES,
                                 PP_SCHEDULES, PP_SIZES, PP_STAGE, REFERENCE_STAGE, ROOT, SECTIONS,
                                 SIZE_KEYS, STAGES, SUBSECTIONS, BenchError, rel, size_text, sizes,
                                 split_label, stage_label)
from bench_driver.arithmetic import (ATTENTION_SPANS, add_derived, attention_ms,
                                     attention_ms_per_step, attention_series, bus_gbps, cp_plan,
                                     divides, left_out_list, median_spread, mfu, pp_plan,
                                     pp_series, speedup, steady_mean, summarise_attention,
                                     summarise_point, summarise_pp, sweep_series, tflops_per_rank,
                                     trace_lanes)
from bench_driver.tables import (ATTENTION_FIELDS, COLUMNS, CP_CSV_FIELDS, CSV_FIELDS, PP_FIELDS,
                                 _f, md_table, missing_cells, read_csv_rows, write_csv)
from bench_driver.page import (INTRO, PLACEHOLDER, benchmarks_md, fenced, mesh_points_of, ran_text,
                               ran_text_from_csv, replace_intro, replace_section,
                               replace_subsection, section_body, show)
from bench_driver.microbench import (bench_name, device_description, load_average, measured_peak,
                                     parse_collectives, parse_gemm, size_label, to_us)
from bench_driver.runner import (Driver, config_flags, configs_for, run, trace_path)
from bench_driver.plots import (cpu_note, plot, plot_cp_attention, plot_pp_bubble, pyplot)
from bench_driver.render import (Render, cell, oversubscribed)
from bench_driver.verify import (missing_outputs, verify, verify_cp, verify_pp)
from bench_driver.projection import (GPU_DEVICE_FILE, GPU_RUNS, MEASURED_CHECK, drive_projection,
                                     error_line, latest_gpu_run, measured_check,
                                     projection_section)
from bench_driver.drive import (datasheet_file, drive, drive_from_logs, drive_text,
                                from_logs_outputs, main, parts, rank_list, stage_list)

if __name__ == "__main__":
    sys.exit(main())
