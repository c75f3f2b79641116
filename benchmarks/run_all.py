"""Run every benchmark in turn (`make bench`); each prints its own table of ratios."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
BENCHMARKS = [
    "bench_build.py",
    "bench_run.py",
    "bench_memory.py",
    "bench_ckpt.py",
    "bench_dataflow.py",
]

if __name__ == "__main__":
    failed = []
    for name in BENCHMARKS:
        print(f"== {name}", flush=True)
        if subprocess.run(
            [
                sys.executable,
                str(HERE / name),
            ]
        ).returncode:
            failed.append(name)
    sys.exit(1 if failed else 0)
