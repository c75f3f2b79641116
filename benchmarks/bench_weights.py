"""Building a model larger than the build machine: peak memory of a streamed build.

A Llama (16 layers, width 2048, MLP 8192, vocab 32000: about 4.8 GB of fp32 weights) is saved
with `save_pretrained` (shards of 500 MB and an index). Then, each in a fresh process:
  - tessel builds it for 4 devices of 16 GB from the model on the meta device
    (`tessel.empty_weights()`) with `weights=` the checkpoint: every rank's slices are read from
    the checkpoint as the package is written;
  - tessel builds it for the same devices from the model loaded in memory (`from_pretrained`), the
    usual way, for comparison;
  - a process that only imports torch, transformers and tessel, for the floor every build pays.
Each row gives the process's peak RSS (ru_maxrss) and the checkpoint's size over it.

    python benchmarks/bench_weights.py [--layers 16] [--hidden 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

MIB = 2**20


def child(mode: str, folder: str, layers: int, hidden: int) -> None:
    """One measured process: prints a JSON line with its peak RSS and what it did."""
    import torch
    from transformers import LlamaForCausalLM

    import tessel
    from tessel.demo import llama_config

    config = llama_config(layers, hidden, heads=16, vocab=32000)
    ids = torch.randint(0, 32000, (1, 64), generator=torch.Generator().manual_seed(0))
    out = {}
    t = time.perf_counter()
    if mode == "save":
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="500MB")
    elif mode == "streamed":
        with tessel.empty_weights():
            model = LlamaForCausalLM(config).eval()
        built = tessel.build(
            model, {"input_ids": ids, "use_cache": False}, cluster=4, weights=folder
        )
        out["package_bytes"] = built.save(os.path.join(folder, "..", "streamed")).stat().st_size
    elif mode == "loaded":
        model = LlamaForCausalLM.from_pretrained(folder).eval()
        built = tessel.build(model, {"input_ids": ids, "use_cache": False}, cluster=4, verify=False)
        out["package_bytes"] = built.save(os.path.join(folder, "..", "loaded")).stat().st_size
    out["seconds"] = time.perf_counter() - t
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out))


def run(mode: str, folder: str, layers: int, hidden: int) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, "--child", mode, folder, "--layers", str(layers),
         "--hidden", str(hidden)],
        capture_output=True,
        text=True,
        check=True,
    )  # fmt: skip
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.layers, args.hidden)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "ckpt")
        run("save", folder, args.layers, args.hidden)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        rows = [(mode, run(mode, folder, args.layers, args.hidden)) for mode in
                ("imports", "streamed", "loaded")]  # fmt: skip
    print(
        f"Llama {args.layers} layers, width {args.hidden}, vocab 32000: checkpoint "
        f"{size / MIB:.0f} MiB; built for 4 CPU devices of 16 GB"
    )
    print(f"{'process':<34} {'peak RSS MiB':>12} {'checkpoint / peak':>17} {'seconds':>8}")
    labels = {
        "imports": "imports only (torch, transformers)",
        "streamed": "tessel build --weights (meta model)",
        "loaded": "tessel build (model in memory)",
    }
    for mode, r in rows:
        print(
            f"{labels[mode]:<34} {r['peak_rss'] / MIB:>12.0f} {size / r['peak_rss']:>17.2f} "
            f"{r['seconds']:>8.1f}"
        )


if __name__ == "__main__":
    main()
