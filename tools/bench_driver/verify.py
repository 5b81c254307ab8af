"""Reading the outputs back: every expected file, row and cell of the section and of stage 08's and
stage 09's subsections.
"""
import math
import re

from .config import SUBSECTIONS
from .tables import ATTENTION_FIELDS, COLUMNS, missing_cells, read_csv_rows
from .page import section_body


def missing_outputs(paths):
    """verify*'s first problems: each of the files that is absent or empty."""
    return [f"missing output: {p}" for p in paths if not p.is_file() or p.stat().st_size == 0]


def verify(out, device, expected, peak_measured, reference_ran, sections):
    """Reads the outputs back: the files exist, the CSV has every expected row and cell, the
    markdown has the sections and one table row per CSV row. Returns the problems."""
    csv_path = out / "benchmarks" / f"{device}.csv"
    md_path = out / "benchmarks.md"
    figs = [out / "figures" / f"bench_{device}_{k}.svg"
            for k in ("step_ms", "exposed_comm", "breakdown")]
    if problems := missing_outputs([csv_path, md_path] + figs):
        return problems
    rows = read_csv_rows(csv_path)
    problems += missing_cells(rows, expected, peak_measured, reference_ran)
    text = md_path.read_text()
    for name in sections:
        if f"<!-- tpx-bench:begin {name} -->" not in text:
            problems.append(f"{md_path}: no section '{name}'")
    body = section_body(text, device)
    for name in SUBSECTIONS:  # their own tables: verify_cp, verify_pp
        if f"<!-- tpx-bench:begin {device}-{name} -->" in body:
            head, rest = body.split(f"<!-- tpx-bench:begin {device}-{name} -->", 1)
            body = head + rest.split(f"<!-- tpx-bench:end {device}-{name} -->", 1)[-1]
    for r in rows:
        if not re.search(rf"^\| {re.escape(r['stage'])} \| {r['n']} \| {device} \|", body, re.M):
            problems.append(f"{md_path}: no table row for {r['config']}/{r['stage']}/N={r['n']}")
    table_rows = [ln for ln in body.splitlines()
                  if re.match(r"^\| 0[1-9]_\w+(?: [A-Z]\d+)? \| \d+ \|", ln)]
    width = len([h for _, h, _ in COLUMNS if h])
    for ln in table_rows:
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if len(cells) != width or any(c == "" for c in cells):
            problems.append(f"{md_path}: incomplete row: {ln}")
    if len(table_rows) != len(rows):
        problems.append(f"{md_path}: {len(table_rows)} table rows for {len(rows)} CSV rows")
    return problems


def verify_cp(out, device, expected, expected_attention, peak_measured):
    """Reads stage 08's outputs back: the two CSVs and the plot exist, the stage table has every
    expected point and cell, the attention CSV every expected (S, C) with a positive time (and
    the ring steps' time and rank 0's cp_attention_ms where C > 1), and the subsection one
    table row per CSV row."""
    csv_path = out / "benchmarks" / f"{device}_cp.csv"
    att_path = out / "benchmarks" / f"{device}_cp_attention.csv"
    fig = out / "figures" / f"bench_{device}_cp_attention.svg"
    md_path = out / "benchmarks.md"
    if problems := missing_outputs((csv_path, att_path, md_path) +
                                   ((fig,) if expected_attention else ())):
        return problems
    rows = read_csv_rows(csv_path)
    att = read_csv_rows(att_path)
    problems += missing_cells(rows, expected, peak_measured, True)
    have = {(int(r["seq"]), int(r["c"])): r for r in att}
    for seq, c in expected_attention:
        if (seq, c) not in have:
            problems.append(f"no attention row for S {seq}, C {c}")
    for (seq, c), r in have.items():
        for field in ATTENTION_FIELDS:
            v = r.get(field, "")
            if v == "" and field in ("blocks_ms", "cp_attention_ms_rank0") and c == 1:
                continue  # stage 08 at C = 1 is stage 07: no ring blocks to time
            try:
                ok = math.isfinite(float(v)) and float(v) > 0
            except ValueError:
                ok = False
            if not ok:
                problems.append(f"attention S={seq} C={c}: {field} is '{v}'")
    body = section_body(md_path.read_text(), f"{device}-cp")
    if not body:
        problems.append(f"{md_path}: no section '{device}-cp'")
        return problems
    for r in rows:
        if not re.search(rf"^\| {re.escape(r['stage'])} \| {r['c']} × {r['t']} \| {r['n']} \|",
                         body, re.M):
            problems.append(f"{md_path}: no table row for {r['config']}/{r['stage']}/N={r['n']}")
    for r in att:
        if not re.search(rf"^\| {r['seq']} \| {r['c']} \| {r['n']} \|", body, re.M):
            problems.append(f"{md_path}: no attention row for S={r['seq']} C={r['c']}")
    return problems


def verify_pp(out, device, expected):
    """Reads stage 09's outputs back: the CSV and the plot exist, the CSV has a row for every
    expected (schedule, P, V, M) with a measured bubble in [0, 1) and its spread around it, a
    positive step time and pp bytes, a live count per pipeline rank, and a formula wherever the
    schedule has one (ZB-H1 below M = P has none); the subsection one table row per CSV row."""
    csv_path = out / "benchmarks" / f"{device}_pp.csv"
    fig = out / "figures" / f"bench_{device}_pp_bubble.svg"
    md_path = out / "benchmarks.md"
    if problems := missing_outputs((csv_path, md_path) + ((fig,) if expected else ())):
        return problems
    rows = read_csv_rows(csv_path)
    have = {(r["schedule"], int(r["p"]), int(r["v"]), int(r["m"])): r for r in rows}
    for point in expected:
        if point not in have:
            problems.append(f"no row for {point[0]} P={point[1]} V={point[2]} M={point[3]}")
    body = section_body(md_path.read_text(), f"{device}-pp")
    if not body:
        return problems + [f"{md_path}: no section '{device}-pp'"]
    for (s, p, v, m), r in have.items():
        where = f"{s} P={p} V={v} M={m}"

        def number(field):
            try:
                x = float(r.get(field, ""))
            except ValueError:
                return None
            return x if math.isfinite(x) else None
        lo, mid, hi = (number(k) for k in ("bubble_min", "bubble", "bubble_max"))
        if None in (lo, mid, hi) or not 0 <= lo <= mid <= hi < 1:
            problems.append(f"{where}: bubble {r.get('bubble')!r} not in [0, 1) within its "
                            f"spread {r.get('bubble_min')!r}–{r.get('bubble_max')!r}")
        for field in ("step_ms", "pp_bytes"):
            if not (number(field) or 0) > 0:
                problems.append(f"{where}: {field} is '{r.get(field)}'")
        if len(r.get("live_peak", "").split()) != p:
            problems.append(f"{where}: live_peak '{r.get('live_peak')}' has not {p} ranks")
        if number("formula") is None and not (s == "zb-h1" and m < p):
            problems.append(f"{where}: no formula bubble")
        if not re.search(rf"^\| {re.escape(s)} \| {p} \| {v} \| {m} \|", body, re.M):
            problems.append(f"{md_path}: no table row for {where}")
    return problems
