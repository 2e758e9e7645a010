"""Routing report sizes: a full snapshot against the deltas, on a real block pool. No Ray, no model.

    python -m loadtest.benchmarks.bench_report_sizes [--cached-blocks 100000] [--tokens-per-s 300 5000]

A BlockPool holds --cached-blocks idle cached blocks (real chained hashes, 16-token blocks), as
a replica's prefix cache does at steady state. For each rate, the replica then computes that
many new tokens a second for a few seconds: every block they fill is allocated (evicting the
least recently used cached block) and cached, so each second brings rate / 16 hashes in and as
many out. The RoutingReportBuilder builds one report a second, as LLMServer does, and a
PrefixIndex parses and applies each (timed: a router's cost per report). Sizes are len(json.dumps(report.to_dict())); the last line is one
JSON object with them.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from contracts import RoutingReport
from model_worker.sched.block_pool import BlockPool
from model_worker.sched.hashing import hash_block_tokens
from router.prefix_index import PrefixIndex
from router.report_builder import RoutingReportBuilder

BLOCK_SIZE = 16


def report_bytes(report: Any) -> int:
    return len(json.dumps(report.to_dict()))


def fill_blocks(pool: BlockPool, num_blocks: int, parent: int) -> int:
    """Compute num_blocks new blocks, each cached then idle; returns the last block's hash."""
    for _ in range(num_blocks):
        (block,) = pool.allocate(1)
        parent = hash_block_tokens(parent, range(parent % 1000, parent % 1000 + BLOCK_SIZE))
        pool.cache(block, parent, [0] * BLOCK_SIZE)
        pool.free([block])
    return parent


def measure(cached_blocks: int, tokens_per_s: float, seconds: int = 6, history: int = 4) -> dict[str, Any]:
    """Sizes of the first report (full) and of the steady deltas after, at one rate."""
    pool = BlockPool(cached_blocks + 64)
    parent = fill_blocks(pool, cached_blocks, 0)
    builder = RoutingReportBuilder(full_report_every=1_000_000, history=history)
    index = PrefixIndex()

    def report() -> tuple[int, float]:
        """The next report's size, and the router's time to parse and apply it (best of 3: a
        replay changes nothing)."""
        built = builder.build("r0", cache_seq=pool.cache_seq, changes_since=pool.changes_since,
                              snapshot=pool.cached_hashes, num_free_kv_blocks=pool.num_free_blocks,
                              num_total_kv_blocks=pool.num_blocks, block_size=BLOCK_SIZE)
        plain = built.to_dict()
        times = []
        for _ in range(3):
            started = time.perf_counter()
            if not index.apply_report("r0", RoutingReport.from_dict(plain), 0.0):
                raise RuntimeError("a report the router could not apply exactly")
            times.append(time.perf_counter() - started)
        return report_bytes(built), min(times)

    full_bytes, full_apply_s = report()
    blocks_per_s = max(1, round(tokens_per_s / BLOCK_SIZE))
    deltas = []
    for _ in range(seconds):
        parent = fill_blocks(pool, blocks_per_s, parent)
        deltas.append(report())
    if set(index.reported_hashes("r0")) != set(pool.cached_hashes()):
        raise RuntimeError("the router's set differs from the pool's")
    # The last delta covers `history` seconds of changes: the steady size.
    delta_bytes, delta_apply_s = deltas[-1]
    stored, removed = pool.changes_since(pool.cache_seq - 2 * blocks_per_s) or ((), ())
    one_period_bytes = len(json.dumps([list(stored), list(removed)]))
    return {"cached_blocks": cached_blocks, "tokens_per_s": tokens_per_s, "hashes_per_s_each_way": blocks_per_s,
            "full_bytes": full_bytes, "delta_bytes": delta_bytes, "history": history,
            "one_second_of_changes_bytes": one_period_bytes, "full_parse_apply_ms": round(full_apply_s * 1000, 2),
            "delta_parse_apply_ms": round(delta_apply_s * 1000, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cached-blocks", type=int, default=100_000)
    p.add_argument("--tokens-per-s", type=float, nargs="+", default=[300.0, 5000.0])
    p.add_argument("--history", type=int, default=4, help="reports a delta covers (RoutingReportBuilder)")
    args = p.parse_args(argv)
    rows = [measure(args.cached_blocks, rate, history=args.history) for rate in args.tokens_per_s]
    for row in rows:
        print(f"{row['cached_blocks']} cached blocks, {row['tokens_per_s']:g} tok/s: full {row['full_bytes']:,} B "
              f"(parsed and applied in {row['full_parse_apply_ms']} ms), delta over {row['history']} s {row['delta_bytes']:,} B "
              f"(in {row['delta_parse_apply_ms']} ms), one second of changes {row['one_second_of_changes_bytes']:,} B")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
