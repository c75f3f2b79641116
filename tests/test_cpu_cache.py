"""The CPU workers' block cache: freed blocks serve the next request of their size, what it
holds never passes its high-water mark of blocks in use, and without a compiler workers run
without it and say so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tests.conftest import hf_llama, subprocess_env, token_ids

import tessel
from tessel.runtime import cpu_cache

needs_cache = pytest.mark.skipif(
    cpu_cache.library() is None, reason="the block cache cannot be built here (no C++ compiler)"
)

# Three rounds of large tensors in one process with the cache installed: the same sizes twice,
# then one larger than any kept block. Each round reports its values and the cache's counts.
_ROUNDS = """
import json, torch
from tessel.runtime import cpu_cache
cpu_cache.install(cpu_cache.library())
report = []
for sizes in ([65536, 131072, 196608], [65536, 131072, 196608], [262144]):
    before = cpu_cache.counts()
    made = [torch.full((n,), float(i + 1)) for i, n in enumerate(sizes)]
    sums = [t.sum().item() for t in made]
    during = cpu_cache.counts()
    while made:  # freed first to last: the first is the oldest kept
        made.pop(0)
    report.append({"sums": sums, "before": before, "during": during, "after": cpu_cache.counts()})
print(json.dumps(report))
"""


@needs_cache
def test_kept_blocks_serve_their_size_and_the_total_stays_within_the_peak_in_use():
    done = subprocess.run(
        [sys.executable, "-c", _ROUNDS], env=subprocess_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    first, again, larger = json.loads(done.stdout)
    for r, sizes in zip((first, again, larger), ([65536, 131072, 196608],) * 2 + ([262144],)):
        assert r["sums"] == [float((i + 1) * n) for i, n in enumerate(sizes)]
    delta = lambda r, key: r["during"][f"cpu_cache_{key}"] - r["before"][f"cpu_cache_{key}"]
    # the first round maps fresh blocks, the second gets every one of them back
    assert (delta(first, "misses"), delta(first, "hits")) == (3, 0)
    assert (delta(again, "misses"), delta(again, "hits")) == (0, 3)
    # 1.5 MiB were in use at once; a 1 MiB block then fits only once all three kept ones, the
    # oldest first, are dropped (with the first two dropped, 768 KiB + 1 MiB would pass 1.5 MiB)
    peak = 4 * (65536 + 131072 + 196608)
    assert again["after"]["cpu_cache_bound_bytes"] == peak
    assert delta(larger, "misses") == 1 and delta(larger, "dropped") == 3
    for r in (first, again, larger):
        for counts in (r["during"], r["after"]):
            held = counts["cpu_cache_used_bytes"] + counts["cpu_cache_kept_bytes"]
            assert held <= counts["cpu_cache_bound_bytes"] == peak


@needs_cache
def test_a_corrupt_cached_library_is_built_again_before_anything_maps_it(tmp_path):
    """In fresh processes (one that has mapped a library keeps it mapped)."""
    env = subprocess_env(TESSEL_CACHE_DIR=str(tmp_path / "cache"))
    find = "from tessel.runtime import cpu_cache; print(cpu_cache.library())"

    def library() -> tuple[str, str]:
        done = subprocess.run([sys.executable, "-c", find], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip(), done.stderr

    built, _ = library()
    good = open(built, "rb").read()
    garbage = tmp_path / "garbage.so"
    garbage.write_bytes(b"\0" * len(good))  # mapping this would kill the process
    os.replace(garbage, built)
    again, said = library()
    assert again == built and open(again, "rb").read() == good
    assert f"{built} does not match the digest kept beside it; building it again" in said
    done = subprocess.run([sys.executable, "-c", _ROUNDS], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # and it maps and serves a process


@needs_cache
def test_a_training_session_s_workers_allocate_from_the_cache(tmp_path):
    # a vocabulary of 2048 makes logits and their gradient large blocks (256 KiB per replica)
    model = hf_llama(vocab=2048).train()
    batch = {"input_ids": token_ids(4, 16, 2048), "labels": token_ids(4, 16, 2048, seed=2)}
    built = tessel.build(
        model,
        batch,
        cluster=2,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
    )
    path = built.save(tmp_path / "train")
    tessel.initialize({"ge.graphRunMode": "1"})
    try:
        with tessel.Session() as session:
            session.load_graph(0, {}, path)
            for _ in range(3):
                session.run_graph(0, batch)
            stats = session.training_stats(0)
    finally:
        tessel.finalize()
    # after the first step, the steps' large tensors come back from kept blocks
    assert stats["cpu_cache_hits"] > stats["cpu_cache_misses"] > 0, stats
    held = stats["cpu_cache_used_bytes"] + stats["cpu_cache_kept_bytes"]
    assert held <= stats["cpu_cache_bound_bytes"], stats
