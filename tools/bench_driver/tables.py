"""The stage table's columns, the CSV files' fields, reading and writing the CSVs, a markdown table,
and which cells of the table are missing.
"""
import csv
import math


# Columns of the stage table: (CSV name, markdown heading, formatter). Empty cells are errors
# unless the column says why it may be empty (see missing_cells).
def _f(digits):
    return lambda v: "—" if v is None else f"{v:.{digits}f}"


COLUMNS = [
    ("config", None, str),
    ("stage", "stage", str),
    ("n", "N", str),
    ("device", "device", str),
    ("dtype", "dtype", str),
    ("step_ms", "step ms (median)", _f(2)),
    ("spread", "spread (min–max)", str),
    ("tflops", "TFLOP/s per rank", _f(4)),
    ("mfu", "MFU per rank", lambda v: "—" if v is None else f"{100 * v:.1f} %"),
    ("exposed_ms", "exposed comm ms", _f(2)),
    ("bus_gbps", "comm bus GB/s", _f(3)),
    ("peak_mib", "peak MiB", _f(1)),
    ("saved_mib", "saved act MiB", _f(2)),
    ("speedup", "speed-up vs 03", lambda v: "—" if v is None else f"{v:.2f}×"),
]
CSV_FIELDS = ["config", "hidden", "heads", "ffn", "seq", "batch", "layers", "steps", "stage", "n",
              "device", "dtype", "repeats", "step_ms", "step_ms_min", "step_ms_max", "tflops",
              "peak_tflops", "mfu", "exposed_ms", "bus_bytes", "bus_gbps", "peak_mib", "saved_mib", "speedup"]
# Stage 08's subsection: its stage table (the mesh C × T besides), and the attention sweep.
CP_CSV_FIELDS = CSV_FIELDS + ["c", "t"]
PP_FIELDS = ["schedule", "p", "v", "m", "n", "repeats", "steps", "bubble", "bubble_min",
             "bubble_max", "formula", "step_ms", "pp_bytes", "live_peak"]
ATTENTION_FIELDS = ["seq", "c", "n", "t", "repeats", "steps", "attention_ms", "attention_ms_min",
                    "attention_ms_max", "blocks_ms", "cp_attention_ms_rank0", "step_ms", "share"]


def missing_cells(rows, expected, peak_measured, reference_ran):
    """Every problem with the table: expected (config, stage, N) points without a row, and empty
    or non-finite cells. MFU may be empty only without a measured peak, the speed-up only when
    stage 03 did not run."""
    problems = []
    have = {(r.get("config"), r.get("stage"), str(r.get("n"))): r for r in rows}
    for point in expected:
        if (point[0], point[1], str(point[2])) not in have:
            problems.append(f"no row for config {point[0]}, stage {point[1]}, N {point[2]}")
    for r in rows:
        where = f"{r.get('config')}/{r.get('stage')}/N={r.get('n')}"
        for field in CSV_FIELDS:
            v = r.get(field)
            if v in (None, "") or (isinstance(v, float) and not math.isfinite(v)):
                if field in ("mfu", "peak_tflops") and not peak_measured:
                    continue
                if field == "speedup" and not reference_ran:
                    continue
                problems.append(f"{where}: no {field}")
            elif isinstance(v, str) and v.lower() in ("nan", "inf", "-inf"):
                problems.append(f"{where}: {field} is {v}")
    return problems


def md_table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def write_csv(rows, path, fields=CSV_FIELDS):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else
                            f"{r[k]:.6g}" if isinstance(r[k], float) else r[k])
                        for k in fields})


def read_csv_rows(path):
    """A CSV file's rows, as dicts of strings."""
    with open(path) as f:
        return list(csv.DictReader(f))
