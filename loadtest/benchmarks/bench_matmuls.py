"""A decoder's matmuls at a step's row count: our panel kernel against oneDNN's packed matmuls.

    python -m loadtest.benchmarks.bench_matmuls                         # SmolLM2's shapes, float32, 1-256 rows
    python -m loadtest.benchmarks.bench_matmuls --rows 1,8,64 --dtypes float32,bfloat16

Every layer's four matrices (q/k/v, o, gate/up, down) of SmolLM2-135M's shapes by default, random
weights, one copy a layer, so a pass reads them from memory as a decode step does (30 layers of
float32: 424 MB, far past the last-level cache). A turn multiplies x of --rows rows by every
matrix once, through `panel_linear` (model_worker/runner/cpu_kernels) and through `linear.linear`
(oneDNN, the weights packed at load); the two alternate, --turns times each, and each turn is the
mean of --passes passes after one unmeasured. What decides `ops._FASTER_UP_TO`, the row count up
to which a step goes through the panels.

Prints a table and, last, one JSON object: the best turn's milliseconds a pass, by dtype, rows and
path, and panels over oneDNN.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from model_worker.runner import linear as packed
from model_worker.runner.cpu_kernels import ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (out_features, in_features) of a SmolLM2-135M layer: q/k/v fused, o, gate/up fused, down.
SMOLLM2_MATRICES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256", help="comma-separated row counts")
    p.add_argument("--dtypes", default="float32")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--turns", type=int, default=3, help="turns of each path, alternated")
    p.add_argument("--passes", type=int, default=3, help="passes over every matrix a turn")
    args = p.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    for name in args.dtypes:
        if name not in DTYPES:
            p.error(f"--dtypes: {name!r} is not one of {', '.join(DTYPES)}")
    if min(args.rows) < 1 or min(args.layers, args.threads, args.turns, args.passes) < 1:
        p.error("--rows, --layers, --threads, --turns and --passes must be positive")
    return args


def pass_ms(run: Callable[[], None], passes: int) -> float:
    run()
    started = time.perf_counter()
    for _ in range(passes):
        run()
    return (time.perf_counter() - started) / passes * 1000


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, dict[str, float]]] = {}
    print(f"{'dtype':9} {'rows':>5} {'panels ms':>10} {'oneDNN ms':>10} {'ratio':>6}")
    for name in args.dtypes:
        dtype = DTYPES[name]
        if not ops.has_panel_linear(dtype) or not packed.packs("cpu", dtype):
            print(f"{name:9} skipped: panel_linear or oneDNN's packed matmul does not run it here")
            continue
        weights = [[(torch.randn(out_f, in_f, generator=generator) * in_f ** -0.5).to(dtype)
                    for out_f, in_f in SMOLLM2_MATRICES] for _ in range(args.layers)]
        panels = [[ops.pack_panels(w) for w in layer] for layer in weights]
        onednn = [[packed.pack(w) for w in layer] for layer in weights]
        del weights
        for rows in args.rows:
            x = {in_f: torch.randn(rows, in_f, generator=generator).to(dtype) for _, in_f in SMOLLM2_MATRICES}

            def through_panels() -> None:
                for layer in panels:
                    for w, (_, in_f) in zip(layer, SMOLLM2_MATRICES):
                        ops.panel_linear(x[in_f], w)

            def through_onednn() -> None:
                for layer in onednn:
                    for w, (_, in_f) in zip(layer, SMOLLM2_MATRICES):
                        packed.linear(x[in_f], w)

            turns: dict[str, list[float]] = {"panels": [], "onednn": []}
            for _ in range(args.turns):
                turns["panels"].append(pass_ms(through_panels, args.passes))
                turns["onednn"].append(pass_ms(through_onednn, args.passes))
            best = {path: min(times) for path, times in turns.items()}
            best["panels_over_onednn"] = best["panels"] / best["onednn"]
            results.setdefault(name, {})[str(rows)] = best
            print(f"{name:9} {rows:>5} {best['panels']:>10.1f} {best['onednn']:>10.1f} {best['panels_over_onednn']:>6.2f}")
    report = {"layers": args.layers, "threads": args.threads, "matrices": SMOLLM2_MATRICES, "ms_per_pass": results}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
