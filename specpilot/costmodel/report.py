"""Human-readable views of an Attribution: a markdown report and a PNG of the factors and per-op-class times.

Plots use matplotlib's object API with the Agg canvas directly, so nothing touches pyplot's global backend
state and it runs on headless hosts.
"""
from __future__ import annotations

from pathlib import Path


from specpilot.costmodel.attribution import Attribution
from specpilot.costmodel.classify import short_kernel_name

US = 1e6  # seconds -> microseconds


def _cell(text: str) -> str:
    """Escape a table cell: C++ kernel names may contain '|' (operator|), which would split the row."""
    return text.replace("|", "\\|")


def _kernel_cell(name: str) -> str:
    return f"`{_cell(short_kernel_name(name, 80))}`" if name else "-"


def _factor_table(attr: Attribution) -> list[str]:
    tau, kernel, overhead = attr.tau, attr.kernel, attr.overhead
    return [
        "| factor | value | as a time ratio |",
        "| --- | ---: | ---: |",
        f"| tau (tree shape) | {tau.tau:.3f} | {tau.gap:.2f}x |",
        f"| kernel | {kernel.factor:.2f} | {kernel.factor:.2f}x |",
        f"| overhead | {overhead.factor:.2f} | {overhead.factor:.2f}x |",
        f"| **total gap** | | **{attr.total_gap:.2f}x** |",
    ]


def _direction_table(attr: Attribution) -> list[str]:
    lines = ["| rank | direction | factor | predicted gain | why |", "| ---: | --- | ---: | ---: | --- |"]
    for rank, d in enumerate(attr.directions, start=1):
        lines.append(f"| {rank} | {d.name.value} | {d.factor:.2f}x | {d.predicted_gain:.2f} | {_cell(d.rationale)} |")
    return lines


def _budget_table(attr: Attribution) -> list[str]:
    lines = ["| budget | tokens/step | verify cost | predicted speedup |", "| ---: | ---: | ---: | ---: |"]
    for row in attr.tau.rows:
        best = " (best)" if row.budget == attr.tau.best_budget else ""
        lines.append(f"| {row.budget}{best} | {row.tokens_per_step:.3f} | {row.verify_cost:.3f} | "
                     f"{row.predicted_speedup:.3f} |")
    return lines


def _op_table(attr: Attribution) -> list[str]:
    lines = ["| op class | measured (us/step) | ideal (us/step) | gap | bound | top kernel |",
             "| --- | ---: | ---: | ---: | --- | --- |"]
    for g in attr.kernel.op_gaps:
        gap = f"{g.gap:.2f}x" if g.gap is not None else "-"
        lines.append(f"| {g.op.value} | {g.measured_s * US:.2f} | {g.ideal_s * US:.2f} | {gap} | {g.bound.value} | "
                     f"{_kernel_cell(g.top_kernel)} |")
    return lines


def _kernel_table(attr: Attribution, limit: int = 15) -> list[str]:
    lines = ["| kernel | op classes | us/step | launches/step |", "| --- | --- | ---: | ---: |"]
    for k in attr.kernel.kernels[:limit]:
        ops = ", ".join(op.value for op in k.ops)
        lines.append(f"| {_kernel_cell(k.name)} | {ops} | {k.time_s * US:.2f} | {k.launches:.1f} |")
    return lines


def render_markdown(attr: Attribution) -> str:
    tau, kernel, overhead = attr.tau, attr.kernel, attr.overhead
    sections = [
        "# Cost-model attribution", "",
        f"Total gap to the ceiling: **{attr.total_gap:.2f}x** = tree shape {tau.gap:.2f}x (tau {tau.tau:.3f}) "
        f"x kernels {kernel.factor:.2f}x x overhead {overhead.factor:.2f}x.", "",
        *_factor_table(attr), "",
        "## Directions", "", *_direction_table(attr), "",
        "## Tree shape (tau)", "",
        f"Replayed {tau.steps} steps ({tau.skipped_steps} without a target continuation skipped). Current "
        f"{tau.current_tokens_per_step:.3f} tokens/step (predicted speedup {tau.current_predicted_speedup:.3f}x); "
        f"best-first tree at budget {tau.best_budget}: {tau.optimal_tokens_per_step:.3f} tokens/step "
        f"(predicted speedup {tau.optimal_predicted_speedup:.3f}x).", "",
        *_budget_table(attr), "",
        "## Kernels", "",
        f"Profiled {kernel.measured_s * US:.2f} us/step vs roofline ideal {kernel.ideal_s * US:.2f} us/step "
        f"({kernel.tokens} tokens per forward, {kernel.context} cached keys). {kernel.launches:.1f} launches/step x "
        f"{kernel.launch_latency_s * US:.1f} us = {kernel.launch_overhead_s * US:.2f} us/step of launch latency.", "",
        *_op_table(attr), "", *_kernel_table(attr), "",
        "## Overhead", "",
        f"Wall step {overhead.wall_s * US:.2f} us (draft {overhead.draft_s * US:.2f} us, verify "
        f"{overhead.verify_s * US:.2f} us) vs profiled kernels {overhead.kernel_s * US:.2f} us: "
        f"{overhead.factor:.2f}x.", "",
    ]
    return "\n".join(sections)


def plot(attr: Attribution, path: str | Path) -> Path:
    """Write a PNG: the three factors (as time ratios) and measured vs ideal time per op class."""
    # Imported here: engines on a bare GPU host import the cost model's tree code but have no matplotlib.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(path)
    fig = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(fig)
    factors_ax, ops_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2.2]})

    labels = ["tree shape\n(1/tau)", "kernels", "overhead"]
    values = [attr.tau.gap, attr.kernel.factor, attr.overhead.factor]
    bars = factors_ax.bar(labels, values, color=["tab:blue", "tab:orange", "tab:green"])
    factors_ax.bar_label(bars, fmt="%.2fx")
    factors_ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    factors_ax.set_ylabel("gap factor (1 = at the ceiling)")
    factors_ax.set_title(f"total gap {attr.total_gap:.2f}x")

    gaps = attr.kernel.op_gaps
    xs = range(len(gaps))
    width = 0.4
    ops_ax.bar([x - width / 2 for x in xs], [g.measured_s * US for g in gaps], width, label="measured")
    ops_ax.bar([x + width / 2 for x in xs], [g.ideal_s * US for g in gaps], width, label="ideal")
    ops_ax.set_xticks(list(xs), [g.op.value for g in gaps], rotation=45, ha="right")
    ops_ax.set_ylabel("us per step")
    ops_ax.set_title("kernel time per op class")
    ops_ax.legend()

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out
