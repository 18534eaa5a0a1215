#!/usr/bin/env python3
"""How long `bsr --help` and the planning commands take as whole processes (a benchmark, not a test).

    python docs/bench_startup.py [--runs 15]

Reports the median wall time of each command, and the same for a bare `python -c pass` measured in the same run,
so a noisy machine shows up as a high baseline rather than as a slow bsr.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass (baseline)": [sys.executable, "-c", "pass"],
    "bsr --help": ["bsr", "--help"],
    "bsr plan --W 32 --tokens 524032 -r paper-mtp-on": [
        "bsr",
        "plan",
        "--W",
        "32",
        "--tokens",
        "524032",
        "-r",
        "paper-mtp-on",
    ],
    "bsr plan ... --json": ["bsr", "plan", "--W", "32", "--tokens", "524032", "-r", "paper-mtp-on", "--json"],
    "bsr rws -r paper-mtp-on --tokens 524032": ["bsr", "rws", "-r", "paper-mtp-on", "--tokens", "524032"],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    runs = ap.parse_args().runs
    if not shutil.which("bsr"):
        print("bsr is not on PATH: activate .venv first", file=sys.stderr)
        return 2
    results = {}
    for name, argv in COMMANDS.items():
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            times.append(time.perf_counter() - t0)
        results[name] = statistics.median(times)
    base = results["python -c pass (baseline)"]
    print(f"{'command':52} {'median ms':>10} {'x baseline':>11}")
    for name, t in results.items():
        print(f"{name:52} {t * 1000:10.0f} {t / base:11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
