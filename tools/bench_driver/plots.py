"""The SVG figures (matplotlib): the stage table's step time, exposed communication and breakdown,
stage 08's attention time against S, and stage 09's bubble.
"""
import math

from .config import PP_SCHEDULES
from .arithmetic import attention_series, pp_series


def pyplot(figures):
    """matplotlib's pyplot set up for the SVGs: deterministic (fixed hash salt, and no date when
    saved with metadata={"Date": None}) so re-running does not churn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams["svg.hashsalt"] = "tpx-bench"
    plt.rcParams["font.size"] = 9
    figures.mkdir(parents=True, exist_ok=True)
    return plt


def cpu_note(device):
    return "\ncpu backend: the mechanics, not GPU speed" if device == "cpu" else ""


def plot_cp_attention(rows, device, figures):
    """figures/bench_<device>_cp_attention.svg: attention ms per step against S, a line per C,
    from the attention sweep's rows (attention_series), error bars min–max over the runs; dashed,
    the ring steps' own time where C > 1."""
    plt = pyplot(figures)
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    handles = []  # the legend in C's order, each C's spans before its blocks
    for k, (c, s) in enumerate(sorted(attention_series(rows).items())):
        handles.append(ax.errorbar(s["seq"], s["ms"], yerr=s["err"], marker="o", capsize=3,
                                   color=colors(k),
                                   label=f"C = {c} (N = {c}, T = 1): attention spans"))
        if None not in s["blocks"]:
            handles += ax.plot(s["seq"], s["blocks"], marker="x", linestyle="--", color=colors(k),
                               label=f"C = {c}: its ring steps alone")
    seqs = sorted({r["seq"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seqs, [str(s) for s in seqs])
    ax.minorticks_off()
    # Plain numbers at 1, 2, 5 × 10^k across the drawn range, not only the decades.
    low, high = ax.get_ylim()
    ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(low)),
                                          math.ceil(math.log10(high)) + 1) for m in (1, 2, 5)]
    ticks = [v for v in ticks if low <= v <= high]
    ax.set_yticks(ticks, [f"{v:g}" for v in ticks])
    ax.set_ylim(low, high)
    ax.set_xlabel("S (tokens of the whole sequence)")
    ax.set_ylabel("attention ms per step on one rank (median)")
    ax.grid(True, alpha=0.3)
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"{device}: stage 08's attention time against S (ring){cpu_note(device)}")
    fig.tight_layout(rect=(0, 0.06 * ((len(handles) + 1) // 2), 1, 1))
    path = figures / f"bench_{device}_cp_attention.svg"
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return path


def plot_pp_bubble(rows, device, figures):
    """figures/bench_<device>_pp_bubble.svg: stage 09's measured bubble against M, a panel per P
    and a colour per schedule, from its rows (pp_series): the median with error bars min–max over
    the runs, and dashed the schedule's formula (where it has one) in the same colour; schedules
    whose formulas are the same line (GPipe's and 1F1B's) share one, named after both."""
    plt = pyplot(figures)
    colors = plt.get_cmap("tab10")
    series = pp_series(rows)
    degrees = sorted({p for _, p in series})
    names = [s for s, _ in PP_SCHEDULES if any(k[0] == s for k in series)]
    names += sorted({s for s, _ in series} - set(names))
    fig, axes = plt.subplots(1, len(degrees), figsize=(max(5.0 * len(degrees), 6.4), 5.4),
                             squeeze=False, sharey=True)
    legend = {}  # label -> handle, in the order drawn: per schedule, measured then formula
    for ax, p in zip(axes[0], degrees):
        formulas = {}  # the formula's points -> the schedules drawn with them, in this panel
        for k, name in enumerate(names):
            s = series.get((name, p))
            if not s:
                continue
            v = next((v for n, v in PP_SCHEDULES if n == name), 1)
            label = f"{name}{f' (V = {v})' if v > 1 else ''}: measured (CPU timings)"
            legend.setdefault(label, ax.errorbar(s["m"], s["bubble"], yerr=s["err"], marker="o",
                                                 capsize=3, color=colors(k), label=label))
            drawn = tuple((m, f) for m, f in zip(s["m"], s["formula"]) if f is not None)
            if not drawn:
                continue
            if drawn in formulas:
                formulas[drawn].append(name)
                continue
            formulas[drawn] = [name]
            formulas[drawn].append(ax.plot([m for m, _ in drawn], [f for _, f in drawn],
                                           linestyle="--", marker="x", color=colors(k))[0])
        for names_and_line in formulas.values():
            line, same = names_and_line[1], [names_and_line[0]] + names_and_line[2:]
            label = f"{' and '.join(same)}: formula"
            line.set_label(label)
            legend.setdefault(label, line)
        ms = sorted({m for (_, q), s in series.items() if q == p for m in s["m"]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.minorticks_off()
        ax.set_ylim(0, 1)
        ax.set_xlabel("M (micro-batches)")
        ax.set_title(f"P = {p} (N = {p} ranks)")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("bubble: idle / wall over the pipeline's ranks")
    # One legend below the panels, a schedule's measured line above its formula.
    order = sorted(legend, key=lambda lab: (next((i for i, n in enumerate(names)
                                                  if lab.startswith(n)), len(names)),
                                            "formula" in lab))
    fig.legend([legend[lab] for lab in order], order, loc="lower center", ncol=2, fontsize=8,
               frameon=False)
    fig.suptitle(f"{device}: stage 09's bubble against M, measured and by the formula"
                 f"{cpu_note(device)}")
    fig.tight_layout(rect=(0, 0.045 * ((len(order) + 1) // 2), 1, 1))
    path = figures / f"bench_{device}_pp_bubble.svg"
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return path


def plot(rows, device, stages, figures):
    """The three SVGs of the stage tables."""
    plt = pyplot(figures)
    configs = []
    for r in rows:
        if r["config"] not in configs:
            configs.append(r["config"])
    colors = plt.get_cmap("tab10")
    note = cpu_note(device)
    paths = []

    def panels(title):
        fig, axes = plt.subplots(1, len(configs), figsize=(max(5.2 * len(configs), 6.4), 5.0),
                                 squeeze=False)
        fig.suptitle(title + note)
        return fig, axes[0]

    def save(fig, name, axes):
        # One legend for the panels, below them.
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8,
                   frameon=False)
        fig.tight_layout(rect=(0, 0.06 * ((len(labels) + 2) // 3), 1, 1))
        path = figures / f"bench_{device}_{name}.svg"
        fig.savefig(path, format="svg", metadata={"Date": None})
        plt.close(fig)
        paths.append(path)

    def lines(key, ylabel, name, title, bars):
        fig, axes = panels(title)
        for ax, config in zip(axes, configs):
            ns_all = sorted({r["n"] for r in rows if r["config"] == config})
            for k, stage in enumerate(stages):
                pts = sorted((r for r in rows if r["config"] == config and r["stage"] == stage),
                             key=lambda r: r["n"])
                if not pts:
                    continue
                x = [r["n"] for r in pts]
                y = [r[key] for r in pts]
                if bars:
                    err = [[r[key] - r["step_ms_min"] for r in pts],
                           [r["step_ms_max"] - r[key] for r in pts]]
                    ax.errorbar(x, y, yerr=err, marker="o", capsize=3, color=colors(k),
                                label=stage)
                else:
                    ax.plot(x, y, marker="o", color=colors(k), label=stage)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns_all, [str(n) for n in ns_all])
            ax.minorticks_off()
            ax.set_xlabel("N (ranks)")
            ax.set_ylabel(ylabel)
            ax.set_title(config)
            ax.grid(True, alpha=0.3)
        save(fig, name, axes)

    lines("step_ms", "step ms (median)", "step_ms", f"{device}: step time per stage", True)
    lines("exposed_ms", "exposed comm ms (median)", "exposed_comm",
          f"{device}: exposed communication per stage", False)

    fig, axes = panels(f"{device}: compute and exposed comm at the largest N")
    for ax, config in zip(axes, configs):
        picked = []
        for stage in stages:
            pts = [r for r in rows if r["config"] == config and r["stage"] == stage]
            if pts:
                picked.append(max(pts, key=lambda r: r["n"]))
        labels = [f"{r['stage'][:2]}\nN={r['n']}" for r in picked]
        exposed = [r["exposed_ms"] for r in picked]
        compute = [max(r["step_ms"] - r["exposed_ms"], 0.0) for r in picked]
        ax.bar(labels, compute, color="#4878cf", label="compute (step − exposed comm)")
        ax.bar(labels, exposed, bottom=compute, color="#e08a2c", label="exposed comm")
        ax.set_ylabel("ms per step (median)")
        ax.set_title(config)
        ax.grid(True, axis="y", alpha=0.3)
    save(fig, "breakdown", axes)
    return paths
