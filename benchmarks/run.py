"""Run the benchmarks, print a table, write JSON: `python -m benchmarks.run [P1 P4 ...]`.

Each figure's target is its benchmark's (P1's: c/(a2+b) <= 1.2 at c=1, and at c=16 >= 800
allocations per second with a p99 under 25 ms; see benchmarks/README.md); "met" says whether
this run met it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import sys
from pathlib import Path

from .harness import machine, print_table

BENCHMARKS = {
    "P1": "benchmarks.bench_mirror",
    "P2": "benchmarks.bench_node",
    "P3": "benchmarks.bench_agent_steady",
    "P4": "benchmarks.bench_contract",
    "L1": "benchmarks.load_mirror",
    "P6": "benchmarks.bench_pending",
    "P7": "benchmarks.bench_follower",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"subset of {', '.join(BENCHMARKS)}")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    parser.add_argument("--smoke", action="store_true",
                        help="a handful of iterations, where a benchmark has such a mode (the "
                        "others run --quick): checks that it runs, not what it measures")
    parser.add_argument("--json", default="benchmarks/results/latest.json", metavar="FILE",
                        help="where to write the results (default: %(default)s)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    results = []
    for name in args.names or list(BENCHMARKS):
        print(f"running {name} ...", file=sys.stderr, flush=True)
        bench = importlib.import_module(BENCHMARKS[name]).run
        options = {"quick": args.quick or args.smoke}
        if args.smoke and "smoke" in inspect.signature(bench).parameters:
            options["smoke"] = True
        results.append(bench(**options))
    print_table(results)
    out = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "quick": args.quick or args.smoke,
        "smoke": args.smoke,
        "results": [r.to_dict() for r in results],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
