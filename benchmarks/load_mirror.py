"""L1 mirror under load with faults: 10,000 MirrorAllocation calls while the Kubernetes API fails
5% of its requests, clients retrying; exactly 10,000 effective allocations, 0 duplicates, 0 lost.

    python -m benchmarks.load_mirror [--calls N] [--fault-rate R] [--seed S] [--workers W]
    python -m benchmarks.run L1          (the same run, in the benchmark table)

The run is tests/load/harness.py (the CI test runs it with 500 calls): the real gRPC server and
KubePodStore over an in-process API stand-in that injects 409, 429, 500, 503, timeouts,
connection resets and writes whose answer is lost. Exits 1 unless every pod was written exactly
once with a valid signature and no client gave up.
"""

from __future__ import annotations

import argparse
import sys

from tests.load.harness import LoadReport, run_load

from .harness import Result

FULL, QUICK = 10_000, 1_000


def exact(report: LoadReport) -> bool:
    return (report.effective, report.duplicates, report.lost, report.bad_signatures,
            len(report.errors), report.writes) == (report.calls, 0, 0, 0, 0, report.calls)


def run(quick: bool = False, calls: int | None = None) -> Result:
    report = run_load(calls or (QUICK if quick else FULL))
    result = Result("L1", f"mirror load: {report.calls} calls, 5% API faults, client retries")
    result.add("time for all calls", round(report.seconds, 2), "s")
    result.add("calls per second", round(report.calls / report.seconds), "1/s")
    result.add("effective allocations", report.effective, "pods", f">= {report.calls}")
    result.add("duplicate writes", report.duplicates, "pods", "<= 0")
    result.add("lost allocations", report.lost, "pods", "<= 0")
    result.add("client errors (gave up)", len(report.errors), "calls", "<= 0")
    result.add("injected API faults", report.fault_count, "requests")
    result.add("client retries", report.client_retries, "calls")
    result.notes.extend(report.lines())
    result.notes.extend(report.errors[:5])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load_mirror",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=FULL)
    parser.add_argument("--fault-rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=10)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args(argv)
    report = run_load(args.calls, fault_rate=args.fault_rate, seed=args.seed,
                      workers=args.workers)
    for line in report.lines():
        print(line)
    for error in report.errors[:10]:
        print(f"error: {error}")
    ok = exact(report)
    print("exactly once: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
