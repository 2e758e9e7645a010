"""The figures of docs/simulator.md, drawn from `python -m simulator.validation.bench`'s sim_bench.json.

    python -m simulator.validation.plots bench_results/sim/sim_bench.json docs/img/sim
    python -m simulator.validation.plots --served bench_results/sim_served/served_samples.json docs/img/sim/served_validation.png

Draws what the JSON holds (a part that was not run is skipped): routing at scale (prefix hit rate
and TTFT by replica count and policy), warm spares (replicas ready and TTFT p90 over time after
the step) and report traffic (bytes per replica per second as snapshots and as deltas); with
--served, `simulator.validation.served`'s samples: each case's TTFT CDF, real against simulated, and the
autoscaling case's replicas over time.
Uses loadtest.report's figure helpers (matplotlib without pyplot, imported only here). Each
`*_figure` function builds a Figure from the JSON and returns it; writing it is separate, so the
tests read the drawn series back from the Figure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtest.report import new_figure, save_figure

if TYPE_CHECKING:  # matplotlib loads only when a figure is drawn
    from matplotlib.figure import Figure

POLICY_STYLE = {"prefix_aware": "tab:green", "pow2": "tab:blue", "round_robin": "tab:orange"}


def routing_figure(routing: dict[str, Any]) -> Figure:
    fig, (hit_ax, ttft_ax) = new_figure(ncols=2, width_in=5.5)
    counts = sorted(int(n) for n in routing)
    for policy, color in POLICY_STYLE.items():
        # A policy missing at some size (a run cut short) is drawn where it was run.
        xs = [n for n in counts if policy in routing[str(n)]]
        rows = [routing[str(n)][policy] for n in xs]
        hit_ax.plot(xs, [r["hit_rate"] for r in rows], "o-", color=color, label=policy)
        ttft_ax.plot(xs, [r["ttft_p50_s"] * 1e3 for r in rows], "o-", color=color, label=f"{policy} p50")
        ttft_ax.plot(xs, [r["ttft_p99_s"] * 1e3 for r in rows], "o--", color=color, alpha=0.6, label=f"{policy} p99")
    for ax in (hit_ax, ttft_ax):
        ax.set_xscale("log")
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("replicas")
        ax.grid(True, alpha=0.3)
    hit_ax.set_ylabel("prefix-cache hit rate (prompt tokens)")
    hit_ax.set_ylim(0, 1)
    ttft_ax.set_ylabel("TTFT (ms)")
    hit_ax.legend(fontsize=8)
    ttft_ax.legend(fontsize=7, ncol=2)
    fig.suptitle("Shared-prefix multi-turn, simulated on the H100 profile")
    return fig


def warm_spares_figure(spares: dict[str, Any]) -> Figure:
    fig, (ready_ax, ttft_ax) = new_figure(ncols=2, width_in=5.5)
    step_s = spares.get("step_at_s", 0.0)
    for key in sorted(k for k in spares if k.startswith("spares_")):
        run = spares[key]
        label = f"warm_spares={key.split('_')[1]}"
        if run.get("ready"):
            t, n = zip(*run["ready"])
            ready_ax.step([x - step_s for x in t], n, where="post", label=label)
        if run.get("ttft_p90_bins"):
            t, p90 = zip(*run["ttft_p90_bins"])
            ttft_ax.plot([x - step_s for x in t], p90, ".-", label=label)
    ttft_ax.axhline(spares.get("slo_s", 1.0), color="red", lw=1, ls=":", label="SLO")
    ttft_ax.set_yscale("log")
    ready_ax.set_ylabel("replicas ready")
    ttft_ax.set_ylabel("TTFT p90 per 5-s bin of arrivals (s)")
    for ax in (ready_ax, ttft_ax):
        ax.axvline(0.0, color="grey", lw=1)
        ax.set_xlabel(f"seconds after the 4x step (replicas take {spares.get('replica_start_s', 60):.0f} s to start)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def report_traffic_figure(routing: dict[str, Any]) -> Figure:
    fig, (ax,) = new_figure(width_in=6.0)
    counts = sorted(int(n) for n in routing)
    x = range(len(counts))
    full = [routing[str(n)]["report_bytes_per_replica_s_full"] / 1e3 for n in counts]
    delta = [routing[str(n)]["report_bytes_per_replica_s_delta"] / 1e3 for n in counts]
    ax.bar([i - 0.2 for i in x], full, width=0.4, label="a snapshot every report")
    ax.bar([i + 0.2 for i in x], delta, width=0.4, label="deltas, a snapshot every 60th (the default)")
    ax.set_xticks(list(x), [f"{n} replicas" for n in counts])
    ax.set_ylabel("report bytes per replica per second (KB)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def served_validation_figure(samples: dict[str, Any]) -> Figure:
    """One TTFT CDF per case (real solid, simulated dashed), then the autoscaling replica timelines."""
    from matplotlib.ticker import NullFormatter

    cases = [name for name in samples if samples[name].get("real") or samples[name].get("sim")]
    timeline = "replicas_real" in samples.get("autoscale", {})
    panels = len(cases) + timeline
    ncols = min(4, max(panels, 1))
    fig, axes = new_figure(ncols=ncols, width_in=3.6, nrows=-(-max(panels, 1) // ncols))
    for ax, name in zip(axes, cases):
        for side, style, color in (("real", "-", "tab:blue"), ("sim", "--", "tab:orange")):
            xs = samples[name].get(side) or []
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], style, color=color, label=f"{side} ({len(xs)})")
        values = [x for side in ("real", "sim") for x in samples[name].get(side) or [] if x > 0]
        if values and max(values) > 10 * min(values):  # a log axis only where it spans a decade
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if timeline:
        ax = axes[len(cases)]
        scaling = samples["autoscale"]
        for key, label, style, color in (("replicas_real", "real", "-", "tab:blue"),
                                         ("replicas_sim", "sim", "--", "tab:orange")):
            rows = scaling[key]
            if rows:
                ax.step([r[0] for r in rows], [r[1] for r in rows], style, color=color, where="post",
                        label=f"{label} ready")
                ax.step([r[0] for r in rows], [r[2] for r in rows], ":", color=color, where="post", alpha=0.7,
                        label=f"{label} asked for (running + starting)")
        ax.set_title("autoscale: replicas", fontsize=9)
        ax.set_xlabel("seconds from the load's start")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[panels:]:
        ax.set_visible(False)
    return fig


def plot_served_validation(samples: dict[str, Any], path: Path) -> str:
    return save_figure(served_validation_figure(samples), path)


def bench_figures(result: dict[str, Any]) -> dict[str, Figure]:
    """File name -> figure, for every part of sim_bench.json that was run."""
    figures = {}
    if result.get("routing"):
        figures["routing_scale.png"] = routing_figure(result["routing"])
        figures["report_traffic.png"] = report_traffic_figure(result["routing"])
    if result.get("warm_spares"):
        figures["warm_spares.png"] = warm_spares_figure(result["warm_spares"])
    return figures


def write_plots(result: dict[str, Any], out_dir: Path) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [save_figure(fig, out_dir / name) for name, fig in bench_figures(result).items()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "--served":
        print(plot_served_validation(json.loads(Path(argv[1]).read_text())["cases"], Path(argv[2])))
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    for path in write_plots(json.loads(Path(argv[0]).read_text()), Path(argv[1])):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
