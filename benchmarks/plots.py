"""PNG plots of the benchmarks. `python -m benchmarks compare`: throughput, normalized latency (with
the capacity threshold) and goodput against request rate (one line per system, as in the Orca
and vLLM papers), and a batch-occupancy timeline. `python -m benchmarks step`: a roofline of each
step against its measured floor, and where each step's time goes. `python -m benchmarks spec`: the
speed-up of n-gram speculation over none, against concurrency. `python -m benchmarks structured`:
output tok/s per share of constrained requests, and what the grammar mask costs a step.

Figures are built with matplotlib's object API (no pyplot, so no global figure state and no
display backend); savefig renders them with Agg.
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.figure import Figure

from benchmarks.records import RunResult, StepSpan

COLORS = {
    "conveyor-fcfs": "#1f77b4",
    "conveyor-static": "#ff7f0e",
    "static-batch-end": "#8c564b",
    "hf-generate": "#2ca02c",
}
MARKERS = {
    "conveyor-fcfs": "o",
    "conveyor-static": "s",
    "static-batch-end": "D",
    "hf-generate": "^",
}
JOIN_COLOR, LEAVE_COLOR = "#2ca02c", "#d62728"
DPI = 110
PART_COLORS = {
    "projections": "#1f77b4",
    "attention": "#ff7f0e",
    "other": "#2ca02c",
    "logits_sampling": "#9467bd",
    "engine": "#7f7f7f",
}


def plot_all(
    results: list[RunResult], out_dir: Path, timeline_rate: float, report: dict
) -> list[Path]:
    paths = [
        plot_vs_rate(
            results,
            "request_throughput",
            "throughput (requests/s)",
            "Throughput vs request rate",
            out_dir / "throughput.png",
            diagonal=True,
        ),
        plot_capacity(results, report["capacity"], out_dir / "latency.png"),
        plot_vs_rate(
            results,
            "goodput",
            f"goodput (requests/s with p99 TBT <= {report['goodput']['tbt_slo_s']:g} s)",
            "Goodput vs request rate",
            out_dir / "goodput.png",
            diagonal=True,
        ),
    ]
    # A run's derived view (static-batch-end: conveyor-static's steps) is drawn once.
    timeline, drawn = [], set()
    for r in results:
        if r.request_rate == timeline_rate and r.steps and id(r.steps) not in drawn:
            timeline.append(r)
            drawn.add(id(r.steps))
    if timeline:
        paths.append(plot_timeline(timeline, out_dir / "timeline.png"))
    return paths


def _rate_positions(rates: list[float]) -> dict[float, float]:
    """x position of each rate; 'inf' (all requests at once) sits one gap past the largest."""
    finite = sorted(r for r in rates if not math.isinf(r))
    top = finite[-1] if finite else 1.0
    gap = (finite[-1] - finite[-2]) if len(finite) > 1 else top * 0.5
    return {r: (top + gap if math.isinf(r) else r) for r in rates}


def plot_vs_rate(
    results: list[RunResult], key: str, ylabel: str, title: str, path: Path, diagonal: bool = False
) -> Path:
    rates = sorted({r.request_rate for r in results})
    x_of = _rate_positions(rates)
    fig = Figure(figsize=(6.4, 4.2), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    _draw_systems(ax, results, key, x_of)
    finite = [r for r in rates if not math.isinf(r)]
    if diagonal and finite:
        ax.plot([0, max(finite)], [0, max(finite)], ":", color="gray", label="offered load")
    ax.set_xticks([x_of[r] for r in rates], [_label(r) for r in rates])
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("request rate (requests/s, Poisson)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path)
    return path


def _draw_systems(ax, results: list[RunResult], key: str, x_of: dict[float, float]) -> None:
    """One line per system: summary[key] against the request rate."""
    for system in dict.fromkeys(r.system for r in results):
        runs = sorted((r for r in results if r.system == system), key=lambda r: r.request_rate)
        ax.plot(
            [x_of[r.request_rate] for r in runs],
            [r.summary[key] for r in runs],
            marker=MARKERS.get(system, "o"),
            color=COLORS.get(system),
            label=system,
        )


def plot_capacity(results: list[RunResult], capacity: dict, path: Path) -> Path:
    """Median normalized latency against rate (log scale: past saturation it grows with the
    queue), the capacity threshold, and where each system's curve crosses it."""
    rates = sorted({r.request_rate for r in results})
    x_of = _rate_positions(rates)
    fig = Figure(figsize=(6.4, 4.2), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    _draw_systems(ax, results, "normalized_latency_median", x_of)
    for system in dict.fromkeys(r.system for r in results):
        cap = capacity["systems"].get(system)
        if cap is not None:
            ax.axvline(cap["rate"], color=COLORS.get(system), linestyle=":", linewidth=1)
    if capacity["systems"]:
        ax.axhline(
            capacity["threshold_s_per_token"],
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"capacity threshold ({capacity['factor']:g}x lowest load)",
        )
    ax.set_yscale("log")
    ax.set_xticks([x_of[r] for r in rates], [_label(r) for r in rates])
    ax.set_xlim(left=0)
    ax.set_xlabel("request rate (requests/s, Poisson); dotted: each system's capacity")
    ax.set_ylabel("median normalized latency (s/token)")
    ax.set_title("Normalized latency vs request rate")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.savefig(path)
    return path


def plot_timeline(results: list[RunResult], path: Path) -> Path:
    """One panel per system: requests in the batch at each step (filled steps), requests in
    the system (arrived, not finished; dashed), joins (green ^) and departures (red v)."""
    fig = Figure(figsize=(10, 2.3 * len(results) + 0.8), dpi=DPI, layout="constrained")
    axes = fig.subplots(len(results), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    for ax, result in zip(axes, results, strict=True):
        _draw_occupancy(ax, result)
        ax.set_title(
            f"{result.system}: mean {result.summary['mean_batch_size']:.1f} requests "
            f"per step, {result.summary['num_joins_in_progress']} joined a batch "
            "in progress",
            fontsize=10,
            loc="left",
        )
        ax.set_ylabel("requests")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper right", fontsize=8, ncols=4)
    axes[-1].set_xlabel("time since the first arrival (s)")
    fig.suptitle(f"Batch occupancy at {_label(results[0].request_rate)} requests/s")
    fig.savefig(path)
    return path


def _draw_occupancy(ax, result: RunResult) -> None:
    xs, ys = _occupancy_steps(result.steps)
    color = COLORS.get(result.system)
    ax.fill_between(xs, ys, step="post", alpha=0.35, color=color, linewidth=0)
    ax.step(xs, ys, where="post", color=color, linewidth=1, label="in the batch")
    sx, sy = _in_system(result)
    ax.step(
        sx, sy, where="post", color="black", linestyle="--", linewidth=0.9, label="in the system"
    )
    joins, leaves = _events(result.steps)
    ax.scatter(*joins, marker="^", s=22, color=JOIN_COLOR, zorder=3, label="join")
    ax.scatter(*leaves, marker="v", s=22, color=LEAVE_COLOR, zorder=3, label="leave")


def _occupancy_steps(steps: list[StepSpan]) -> tuple[list[float], list[int]]:
    """Step-function points: each step holds its batch size from its start to the next step's
    start, or drops to 0 at its end when it left nobody unfinished (the batch is empty)."""
    xs, ys = [0.0], [0]
    running: set[str] = set()
    for step in steps:
        xs.append(step.start)
        ys.append(len(step.num_scheduled_tokens))
        running = (running | set(step.num_scheduled_tokens)) - set(step.finished_request_ids)
        if not running:
            xs.append(step.end)
            ys.append(0)
    return xs, ys


def _in_system(result: RunResult) -> tuple[list[float], list[int]]:
    events = sorted(
        [(r.arrival, 1) for r in result.requests] + [(r.finish, -1) for r in result.requests]
    )
    xs, ys, count = [0.0], [0], 0
    for t, delta in events:
        count += delta
        xs.append(t)
        ys.append(count)
    return xs, ys


def _events(steps: list[StepSpan]):
    """Join markers at the start of a request's first step, stacked above the batch size;
    leave markers at the end of its last step, stacked down from the batch size."""
    seen: set[str] = set()
    joins: tuple[list[float], list[float]] = ([], [])
    leaves: tuple[list[float], list[float]] = ([], [])
    for step in steps:
        size = len(step.num_scheduled_tokens)
        new = [r for r in step.num_scheduled_tokens if r not in seen]
        seen.update(new)
        for k in range(len(new)):
            joins[0].append(step.start)
            joins[1].append(size + 0.25 + 0.3 * k)
        for k in range(len(step.finished_request_ids)):
            leaves[0].append(step.end)
            leaves[1].append(size - 0.25 - 0.3 * k)
    return joins, leaves


def _label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


# ---- python -m benchmarks step ------------------------------------------------------------------


def plot_step(report: dict, path: Path) -> Path:
    """Left: a roofline (achieved GFLOP/s against arithmetic intensity, each case joined to its
    floor; the roof from the measured bandwidth and the best measured GEMM rate). Right: each
    case's step time split into the breakdown's parts, as a share of the step, with its floor."""
    cases = report["cases"]
    fig = Figure(figsize=(13, 0.35 * len(cases) + 4), dpi=DPI, layout="constrained")
    roof_ax, parts_ax = fig.subplots(1, 2, width_ratios=[1, 1.1])
    if cases:
        _draw_roofline(roof_ax, cases, report["memory_bandwidth_gb_s"])
        _draw_breakdown(parts_ax, cases, report["categories"])
    fig.suptitle(
        f"One model step: {Path(report['model']).name}, {report['dtype']} on "
        f"{report['device']}, {report['num_threads']} threads"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _draw_roofline(ax, cases: list[dict], bandwidth_gb_s: float) -> None:
    intensity = [
        c["floor"]["flops"] / (c["floor"]["weight_bytes"] + c["floor"]["kv_bytes"]) for c in cases
    ]
    peak = max(c["floor"]["roof_flops_per_s"] for c in cases) / 1e9  # the peaks, in each mix
    xs = [min(intensity) / 2, max(intensity) * 2]
    knee = peak / bandwidth_gb_s
    roof_x = sorted({xs[0], min(max(knee, xs[0]), xs[1]), xs[1]})
    roof_y = [min(bandwidth_gb_s * x, peak) for x in roof_x]
    ax.plot(roof_x, roof_y, color="black", linewidth=1.2, label="roof (measured)")
    for i, (case, x) in enumerate(zip(cases, intensity, strict=True)):
        achieved = case["floor"]["flops"] / case["step_ms"] / 1e6  # GFLOP/s
        at_floor = case["floor"]["flops"] / case["floor"]["ms"] / 1e6
        color = "#1f77b4" if case["kind"] == "decode" else "#d62728"
        ax.plot([x, x], [achieved, at_floor], color=color, alpha=0.4, linewidth=1)
        ax.scatter([x], [at_floor], marker="_", s=80, color=color)
        ax.scatter([x], [achieved], s=22, color=color, zorder=3)
        # alternate above and below: cases of one batch size share an intensity
        offset = (4, 4) if i % 2 else (4, -9)
        ax.annotate(
            case["case"], (x, achieved), fontsize=7, xytext=offset, textcoords="offset points"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title("achieved (dot) vs floor (dash); blue decode, red prefill", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")


def _draw_breakdown(ax, cases: list[dict], categories: list[str]) -> None:
    ys = list(range(len(cases)))[::-1]
    left = [0.0] * len(cases)
    for part in categories:
        widths = [c["breakdown_ms"][part] / _parts_total(c) * 100 for c in cases]
        ax.barh(ys, widths, left=left, color=PART_COLORS.get(part), label=part, height=0.7)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    floors = [min(c["pct_of_floor"], 100) for c in cases]
    ax.scatter(floors, ys, marker="|", s=200, color="black", zorder=3, label="floor")
    labels = [f"{c['case']}  ({c['step_ms']:.0f} ms)" for c in cases]
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of the step (parts measured with hooks; floor = floor / step)")
    ax.set_title("where each step's time goes", fontsize=10)
    ax.legend(fontsize=8, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))


def _parts_total(case: dict) -> float:
    return sum(case["breakdown_ms"].values()) or 1.0


# ---- python -m benchmarks spec ------------------------------------------------------------------


def plot_spec(report: dict, path: Path) -> Path:
    """One panel per workload: output tok/s over no speculation's at each concurrency, one
    line per k (dashed: every draft verified, "fixed"); the concurrencies sit evenly spaced
    (they are usually powers of two)."""
    workloads = list(dict.fromkeys(r["workload"] for r in report["rows"]))
    concurrencies = report["concurrency"]
    fig = Figure(figsize=(5 * len(workloads), 4), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(workloads), sharey=True, squeeze=False)[0]
    for ax, workload in zip(axes, workloads, strict=True):
        ax.axhline(1.0, color="gray", linestyle=":", label="no speculation")
        for policy in report.get("policies", ["adaptive"]):
            for k in report["num_speculative_tokens"]:
                by_c = {
                    r["concurrency"]: r["speedup"]
                    for r in report["rows"]
                    if r["workload"] == workload
                    and r["k"] == k
                    and r.get("policy", "adaptive") == policy
                }
                xs = [i for i, c in enumerate(concurrencies) if by_c.get(c) is not None]
                label = f"ngram k={k}" + (" fixed" if policy == "fixed" else "")
                style = "--" if policy == "fixed" else "-"
                ax.plot(xs, [by_c[concurrencies[i]] for i in xs], style, marker="o", label=label)
        ax.set_xticks(range(len(concurrencies)), [str(c) for c in concurrencies])
        ax.set_xlabel("concurrency (open streams)")
        ax.set_title(workload)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("output tok/s / no speculation's")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"n-gram speculation: {Path(report['model']).name}, {report['output_len']} output tokens"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


# ---- python -m benchmarks structured ------------------------------------------------------------


def plot_structured(report: dict, path: Path) -> Path:
    """Left: mean output tok/s per share of constrained requests (a dot per round), each bar
    labelled with its ratio to the unconstrained run and its valid outputs; the target (0.9x
    the unconstrained) dotted. Right: the grammar mask's ms per step against constrained rows,
    split into filling the bitmask and applying it."""
    summary = report["ratios"]
    fig = Figure(figsize=(11, 4.2), dpi=DPI, layout="constrained")
    speed_ax, mask_ax = fig.subplots(1, 2, width_ratios=[1.4, 1])
    xs = list(range(len(summary)))
    colors = ["#7f7f7f" if s["structured_ratio"] == "matched" else "#1f77b4" for s in summary]
    speed_ax.bar(xs, [s["output_throughput"] for s in summary], color=colors, width=0.6)
    for x, s in zip(xs, summary, strict=True):
        rounds = s["output_throughput_rounds"]
        speed_ax.scatter([x] * len(rounds), rounds, color="black", s=12, zorder=3)
        speed_ax.annotate(
            _structured_label(s),
            (x, max(rounds)),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            fontsize=8,
        )
    base = next((s["output_throughput"] for s in summary if s["structured_ratio"] == 0), None)
    control = next(
        (s["output_throughput"] for s in summary if s["structured_ratio"] == "matched"), None
    )
    if control:  # the target is judged on equal work: the control's output lengths
        speed_ax.axhline(
            0.9 * control, color="gray", linestyle=":", label="target: 0.9x of the control"
        )
        speed_ax.legend(fontsize=8, loc="lower right")
    elif base:
        speed_ax.axhline(0.9 * base, color="gray", linestyle=":", label="target: 0.9x of 0%")
        speed_ax.legend(fontsize=8, loc="lower right")
    speed_ax.set_xticks(
        xs,
        [
            "0%, lengths\nof 100%"
            if s["structured_ratio"] == "matched"
            else f"{s['structured_ratio']:.0%}"
            for s in summary
        ],
    )
    speed_ax.set_xlabel("requests constrained to their JSON schema")
    speed_ax.set_ylabel("output tok/s (mean over rounds)")
    speed_ax.set_ylim(0, max(max(s["output_throughput_rounds"]) for s in summary) * 1.18)
    speed_ax.set_title(f"{report['concurrency']} streams", fontsize=10)
    speed_ax.grid(alpha=0.3, axis="y")
    _draw_mask(mask_ax, report["mask"])
    fig.suptitle(
        f"Structured output: {Path(report['model']).name}, {report['num_prompts']} requests "
        f"per run, {_count(report['rounds'], 'round')}"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _structured_label(summary: dict) -> str:
    speed = summary["vs_unconstrained"]
    label = "" if speed is None else f"{speed:.2f}x"
    if summary.get("vs_matched") is not None:
        label += f" ({summary['vs_matched']:.2f}x of control)"
    if summary["num_structured"]:
        label += f"\nvalid {summary['num_valid']}/{summary['num_structured']}"
    return label


def _draw_mask(ax, mask: list[dict]) -> None:
    xs = list(range(len(mask)))
    fill, apply = [m["fill_ms"] for m in mask], [m["apply_ms"] for m in mask]
    ax.bar(xs, fill, width=0.6, color="#ff7f0e", label="fill the bitmask")
    ax.bar(xs, apply, width=0.6, bottom=fill, color="#9467bd", label="apply it")
    for x, m in zip(xs, mask, strict=True):
        ax.annotate(
            f"{m['step_ms']:.3g}",
            (x, m["step_ms"]),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            fontsize=8,
        )
    ax.set_xticks(xs, [str(m["rows"]) for m in mask])
    ax.set_ylim(0, max(m["step_ms"] for m in mask) * 1.15)
    ax.set_xlabel("constrained rows in the step")
    ax.set_ylabel("ms per step (median)")
    ax.set_title("grammar mask, in process", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
