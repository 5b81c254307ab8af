"""The benchmark driver's code, by concern; tools/bench.py is its command line and re-exports its
names (tools/test_bench.py and tools/check_from_logs.py import them from there).

    config      what the sweep runs: stages, labels, the subsections' sizes, BenchError
    arithmetic  means, medians, TFLOP/s, MFU, bus GB/s, speed-ups, the subsections' plans
    tables      the stage table's columns, the CSVs' fields, reading and writing them
    page        docs/benchmarks.md's text: intro, sections between markers, what ran
    microbench  bench_gemm's peak, bench_collectives' bus bandwidth, the device line
    runner      running a program with its log, the sweep's configs, the Driver
    plots       the SVG figures
    render      a device's section as markdown
    verify      the outputs read back: every file, row and cell
    projection  the projection section and its check against a published GPU run
    drive       the command line and what it runs (the sweep, --only, --from-logs)
"""
