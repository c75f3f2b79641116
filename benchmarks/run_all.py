"""Run every benchmark in turn (`make bench`); each prints its own table of ratios."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
BENCHMARKS = [
    ["bench_build.py"],
    ["bench_build.py", "--nodes", "2", "--layers", "32"],
    ["bench_run.py"],
    ["bench_run.py", "--mesh", "2x2"],
    ["bench_start.py"],
    ["bench_generate.py"],
    ["bench_serve.py"],
    ["bench_slices.py"],
    ["bench_weights.py"],
    ["bench_mesh.py"],
    ["bench_solvers.py"],
    ["bench_memory.py"],
    ["bench_ckpt.py"],
    ["bench_dataflow.py"],
    ["bench_training.py"],
    ["bench_training_api.py"],
    ["bench_estimate.py"],
]

if __name__ == "__main__":
    failed = []
    for name, *options in BENCHMARKS:
        print(f"== {name} {' '.join(options)}", flush=True)
        if subprocess.run([sys.executable, str(HERE / name), *options]).returncode:
            failed.append(name)
    sys.exit(1 if failed else 0)
