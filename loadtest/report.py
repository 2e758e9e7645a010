"""Turn benchmark runs into `report.md` plus PNG plots, from dicts that can be saved as JSON.

A run is a plain dict: label, series (runs of one series form one line on the sweep plot), rate
(offered req/s, None for closed loop), concurrency, summary (`results.summarize` output), results
(`RequestResult.to_dict()` each) and timeline (samples of the server's /metrics: t_s, num_waiting,
num_running, kv_usage, replicas). Any summary value may be None; it renders as "-".

Plots draw on `matplotlib.figure.Figure` directly rather than through pyplot: no GUI backend is
ever chosen and no figure is registered globally, so repeated calls cannot leak figures.
matplotlib is imported only when plotting, so loading and SLO arithmetic need only the stdlib.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtest.results import RequestResult

DPI = 110
MISSING = "-"
# Switch an axis to log scale when its positive values span more than this factor; below it a
# linear axis reads better.
LOG_SCALE_SPAN = 50.0


def load_runs(path: Path | str) -> list[dict]:
    return json.loads(Path(path).read_text())


def save_runs(path: Path | str, runs: list[dict]) -> None:
    Path(path).write_text(json.dumps(runs, indent=1))


def _stat(run: dict, metric: str, key: str | None = None) -> Any:
    """summary[metric][key] (or summary[metric]), None wherever a level is missing."""
    value = (run.get("summary") or {}).get(metric)
    if key is None:
        return value
    return value.get(key) if isinstance(value, dict) else None


def max_rate_under_slo(runs: list[dict], series: str, slo_ttft_s: float) -> float | None:
    """Highest offered rate of `series` whose p99 TTFT is known and within the SLO; None if none."""
    rates = [run["rate"] for run in runs
             if run.get("series") == series and run.get("rate") is not None
             and (p99 := _stat(run, "ttft_s", "p99")) is not None and p99 <= slo_ttft_s]
    return max(rates, default=None)


# ---------------------------------------------------------------------------------------- table

def _fmt(value: float | None, spec: str) -> str:
    return MISSING if value is None else format(value, spec)


def _fmt_ms(value_s: float | None) -> str:
    # One decimal only where it carries information (sub-100 ms); integers above.
    if value_s is None:
        return MISSING
    value_ms = value_s * 1000.0
    # Decide on the rounded value, so 99.99 ms reads "100" like 100.0 ms, not "100.0".
    return f"{value_ms:.1f}" if round(value_ms, 1) < 100 else f"{value_ms:.0f}"


def _fmt_pair_ms(run: dict, metric: str) -> str:
    return f"{_fmt_ms(_stat(run, metric, 'p50'))} / {_fmt_ms(_stat(run, metric, 'p99'))}"


def _fmt_rate(run: dict) -> str:
    if run.get("rate") is not None:
        return f"{run['rate']:g}"
    if run.get("concurrency") is not None:
        return f"closed, c={run['concurrency']}"
    return MISSING


def _fmt_outcomes(run: dict) -> str:
    counts = (_stat(run, key) for key in ("num_ok", "num_shed", "num_errors"))
    return "/".join(MISSING if n is None else str(n) for n in counts)


def _fmt_throughput(value: float | None) -> str:
    return _fmt(value, ".1f" if value is not None and round(value, 1) < 100 else ".0f")


def _table_row(run: dict) -> str:
    goodput = _stat(run, "goodput")
    cells = [
        str(run.get("label", "")).replace("|", "\\|"),
        _fmt_rate(run),
        _fmt_outcomes(run),
        _fmt(_stat(run, "request_throughput"), ".2f"),
        _fmt_throughput(_stat(run, "output_throughput")),
        _fmt_pair_ms(run, "ttft_s"),
        _fmt_pair_ms(run, "itl_s"),
        _fmt_ms(_stat(run, "tpot_s", "p50")),
        _fmt_pair_ms(run, "e2e_s"),
        MISSING if goodput is None else f"{goodput * 100:.1f}%",
    ]
    return "| " + " | ".join(cells) + " |"


TABLE_HEADER = ("Run", "Rate (req/s)", "ok/shed/err", "Done (req/s)", "Output (tok/s)",
                "TTFT p50/p99 (ms)", "ITL p50/p99 (ms)", "TPOT p50 (ms)", "E2E p50/p99 (ms)",
                "Goodput")


def _table(runs: list[dict]) -> list[str]:
    header = "| " + " | ".join(TABLE_HEADER) + " |"
    rule = "|" + "---|" * len(TABLE_HEADER)
    return [header, rule] + [_table_row(run) for run in runs]


# ---------------------------------------------------------------------------------------- plots

def new_figure(ncols: int = 1, width_in: float = 6.0, nrows: int = 1):
    """A figure and its axes, row by row in one flat array."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in * ncols, 4.0 * nrows), dpi=DPI, layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False).ravel()


def save_figure(fig, path: Path) -> str:
    fig.savefig(path, dpi=DPI)
    return path.name


def _log_if_wide(ax, values: list[float], axis: str) -> None:
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > LOG_SCALE_SPAN:
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")


def _series_order(runs: list[dict]) -> list[Any]:
    """Series in order of first appearance, so colours and lines are stable across calls."""
    return list(dict.fromkeys(run.get("series") for run in runs))


def _ok_latencies_s(run: dict) -> tuple[list[float], list[float]]:
    ok = [r for r in map(RequestResult.from_dict, run.get("results") or []) if r.ok]
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    e2es = sorted(r.e2e_s for r in ok if r.e2e_s is not None)
    return ttfts, e2es


def _plot_latency_cdf(out_dir: Path, runs: list[dict]) -> str | None:
    per_run = [(run.get("label", ""), *_ok_latencies_s(run)) for run in runs]
    if not any(ttfts or e2es for _, ttfts, e2es in per_run):
        return None
    fig, axes = new_figure(ncols=2)
    for column, (ax, name) in enumerate(zip(axes, ("TTFT", "E2E latency"))):
        every_value: list[float] = []
        for label, *latencies in per_run:
            values = latencies[column]
            if values:
                # Start each curve at 0 so it rises from the fastest request, as an ECDF does.
                fractions = [i / len(values) for i in range(len(values) + 1)]
                ax.step([values[0], *values], fractions, where="post", label=label)
                every_value += values
        _log_if_wide(ax, every_value, "x")
        ax.set(xlabel=f"{name} (s)", ylabel="fraction of ok requests", title=f"{name} CDF",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if every_value:
            ax.legend(fontsize="small")
    return save_figure(fig, out_dir / "latency_cdf.png")


def _sweep_points(runs: list[dict], series: Any, metric: str, key: str | None
                  ) -> tuple[list[float], list[float]]:
    points = sorted((run["rate"], value) for run in runs
                    if run.get("series") == series and run.get("rate") is not None
                    and (value := _stat(run, metric, key)) is not None)
    return [rate for rate, _ in points], [value for _, value in points]


def _plot_sweep(out_dir: Path, runs: list[dict], slo_ttft_s: float | None) -> str | None:
    swept = [run for run in runs if run.get("rate") is not None]
    if not swept:
        return None
    fig, (ttft_ax, tput_ax) = new_figure(ncols=2)
    ttfts: list[float] = []
    for series in _series_order(swept):
        rates, p99s = _sweep_points(swept, series, "ttft_s", "p99")
        ttft_ax.plot(rates, p99s, marker="o", label=str(series))
        ttfts += p99s
        rates, tputs = _sweep_points(swept, series, "output_throughput", None)
        tput_ax.plot(rates, tputs, marker="o", label=str(series))
    if slo_ttft_s is not None:
        ttft_ax.axhline(slo_ttft_s, linestyle="--", color="red", label=f"SLO {slo_ttft_s:g} s")
        ttfts.append(slo_ttft_s)
    _log_if_wide(ttft_ax, ttfts, "y")
    ttft_ax.set(xlabel="offered rate (req/s)", ylabel="p99 TTFT (s)", title="p99 TTFT vs load")
    tput_ax.set(xlabel="offered rate (req/s)", ylabel="output throughput (tok/s)",
                title="Output throughput vs load")
    tput_ax.set_ylim(bottom=0)  # from zero, so a plateau is not mistaken for a collapse
    for ax in (ttft_ax, tput_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return save_figure(fig, out_dir / "sweep.png")


def _timeline_column(timeline: list[dict], key: str) -> tuple[list[float], list[float]]:
    pairs = [(s["t_s"], s[key]) for s in timeline
             if s.get("t_s") is not None and s.get(key) is not None]
    return [t for t, _ in pairs], [v for _, v in pairs]


def _plot_timeline(out_dir: Path, index: int, run: dict) -> str:
    timeline = run["timeline"]
    fig, (ax,) = new_figure(width_in=8.0)
    for key, name in (("num_waiting", "waiting (queue)"), ("num_running", "running")):
        ax.plot(*_timeline_column(timeline, key), label=name)
    ax.set(xlabel="time since start (s)", ylabel="requests", title=f"Timeline: {run.get('label', '')}")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    times_s, replicas = _timeline_column(timeline, "replicas")
    if replicas:
        # Replica counts are small integers; a second axis keeps them legible next to queue depth.
        replica_ax = ax.twinx()
        replica_ax.step(times_s, replicas, where="post", color="black", linestyle=":",
                        label="replicas")
        replica_ax.set_ylabel("replicas")
        replica_ax.set_ylim(0, max(replicas) + 1)
        replica_ax.yaxis.get_major_locator().set_params(integer=True)
        more_handles, more_labels = replica_ax.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, fontsize="small", loc="upper left")
    return save_figure(fig, out_dir / f"timeline_{index}.png")


def _write_plots(out_dir: Path, runs: list[dict], slo_ttft_s: float | None
                 ) -> list[tuple[str, str]]:
    """(alt text, file name) of every plot written, in report order."""
    images = []
    if name := _plot_latency_cdf(out_dir, runs):
        images.append(("Latency CDFs", name))
    if name := _plot_sweep(out_dir, runs, slo_ttft_s):
        images.append(("Rate sweep", name))
    for index, run in enumerate(runs):
        if run.get("timeline"):
            images.append((f"Timeline: {run.get('label', '')}", _plot_timeline(out_dir, index, run)))
    return images


# --------------------------------------------------------------------------------------- report

def _slo_lines(runs: list[dict], slo_ttft_s: float | None) -> list[str]:
    series_list = _series_order([run for run in runs if run.get("rate") is not None])
    if slo_ttft_s is None or not series_list:
        return []
    lines = ["## SLO", "", f"SLO: p99 TTFT <= {slo_ttft_s:g} s", ""]
    for series in series_list:
        rate = max_rate_under_slo(runs, series, slo_ttft_s)
        shown = "none" if rate is None else f"{rate:g} req/s"
        lines.append(f"- {series}: highest offered rate with p99 TTFT <= SLO: {shown}")
    return lines + [""]


def write_report(out_dir: Path | str, title: str, runs: list[dict],
                 notes: list[str] | None = None, slo_ttft_s: float | None = None) -> Path:
    """Write the plots and report.md into out_dir (created if needed); return report.md's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = _write_plots(out_dir, runs, slo_ttft_s)
    lines = [f"# {title}", ""]
    if notes:
        lines += [f"- {note}" for note in notes] + [""]
    lines += _table(runs) + [""]
    lines += _slo_lines(runs, slo_ttft_s)
    if images:
        lines += ["## Plots", ""] + [f"![{alt}]({name})\n" for alt, name in images]
    report_path = out_dir / "report.md"
    report_path.write_text("\n".join(lines).rstrip() + "\n")
    return report_path
