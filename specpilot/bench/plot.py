"""A bench's speedups as one picture: per variant, its speedup on each benchmark and overall (geometric means over
requests; the overall bar with its bootstrap interval where the report has one), the AR line at 1x, tokens per step
beside each variant's name, and whether every token equalled AR."""
from __future__ import annotations

from pathlib import Path


def short_label(variant: str, width: int = 48) -> str:
    """A variant's name for the picture: a model path cut to its last component (the bench table keeps the whole
    name), the knobs below it, wrapped at their commas to `width` characters (a tree's dozen knobs on one line
    squeezed the bars to a sliver)."""
    name, brace, knobs = variant.partition("{")
    kind, colon, model = name.partition(":")
    if "/" in model:
        model = model.rstrip("/").rsplit("/", 1)[-1]
    lines = [kind + colon + model]
    if brace:
        first, *rest = knobs.split(",")
        lines.append("{" + first)
        for knob in rest:
            if len(lines[-1]) + len(knob) + 1 > width:
                lines[-1] += ","
                lines.append(knob)
            else:
                lines[-1] += "," + knob
    return "\n".join(lines)


def plot_speedups(report: dict, path: str | Path) -> Path | None:
    """report: BenchReport.to_dict() (or a saved bench.json) -> a PNG at path; None where matplotlib is absent
    (bare GPU hosts), so a bench never fails for its picture."""
    try:  # matplotlib's object API with the Agg canvas: nothing touches pyplot's global backend
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    rows = {v: s for v, s in report["summary"].items() if s.get("geomean_speedup")}
    if not rows:
        return None
    benchmarks = sorted({b for s in rows.values() for b in s["per_benchmark"]}) + ["overall"]
    label_lines = max(short_label(v).count("\n") + 2 for v in rows)  # + the tokens/step line
    fig = Figure(figsize=(10, 1.2 + max(0.9, 0.14 * label_lines) * len(rows)))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    height = 0.8 / len(benchmarks)
    for i, b in enumerate(benchmarks):
        ys = [n + (i - (len(benchmarks) - 1) / 2) * height for n in range(len(rows))]
        xs = [(s["geomean_speedup"] if b == "overall" else s["per_benchmark"].get(b)) or 0.0 for s in rows.values()]
        if b != "overall":
            ax.barh(ys, xs, height, label=b)
            continue
        # reports saved before the interval existed have none: a zero-width error bar
        spans = [s.get("geomean_interval") or (x, x) for s, x in zip(rows.values(), xs)]
        xerr = [[x - lo for x, (lo, _) in zip(xs, spans)], [hi - x for x, (_, hi) in zip(xs, spans)]]
        level = next(iter(rows.values())).get("interval_level")
        ax.barh(ys, xs, height, label=f"overall ({level:.0%} interval)" if level else "overall", color="black",
                xerr=xerr, ecolor="tab:red", capsize=2)
        for y, x, (_, hi) in zip(ys, xs, spans):  # the value past the interval's end, clear of its bar
            ax.text(max(x, hi), y, f" {x:.2f}x", va="center", fontsize=8)
    labels = [f"{short_label(v)}\n{s['tokens_per_step']:.2f} tokens/step{'' if s['all_match_ar'] else ', NOT = AR'}"
              for v, s in rows.items()]
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("speedup over the fastest AR (geometric mean over requests)")
    ax.set_title(f"{report['deployment']} on {report['device']}, {report['max_new_tokens']} new tokens")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100, bbox_inches="tight")  # long variant names widen the picture
    return out
