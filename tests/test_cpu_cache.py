"""The CPU workers' block cache: freed memory serves the next requests it holds, whatever their
sizes, what it holds never passes its high-water mark of memory in use, and without a compiler
workers run without it and say so."""

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

# Rounds of large tensors (fp32, sizes in elements) in one process with the cache installed,
# each freed in turn before the next; each round reports its values and the cache's counts.
_MIB = 2**18  # fp32 elements in 1 MiB
_SIZES = (
    [6 * _MIB // 4],
    [_MIB // 4, _MIB // 2, 3 * _MIB // 4],
    [6 * _MIB // 4],
    [3 * _MIB // 8],
    [2 * _MIB],
)
_ROUNDS = f"""
import json, torch
from tessel.runtime import cpu_cache
cpu_cache.install(cpu_cache.library())
report = []
for sizes in {_SIZES}:
    before = cpu_cache.counts()
    made = [torch.full((n,), float(i + 1)) for i, n in enumerate(sizes)]
    sums = [t.sum().item() for t in made]
    during = cpu_cache.counts()
    while made:  # freed first to last
        made.pop(0)
    report.append({{"sums": sums, "before": before, "during": during, "after": cpu_cache.counts()}})
print(json.dumps(report))
"""


def _report(script: str) -> object:
    """What `script`, run in a fresh process, prints as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", script], env=subprocess_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@needs_cache
def test_kept_memory_serves_requests_of_other_sizes_and_never_passes_the_peak_in_use():
    rounds = _report(_ROUNDS)
    for r, sizes in zip(rounds, _SIZES):
        assert r["sums"] == [float((i + 1) * n) for i, n in enumerate(sizes)]
    whole, pieces, again, smaller, larger = rounds
    delta = lambda r, key: r["during"][f"cpu_cache_{key}"] - r["before"][f"cpu_cache_{key}"]
    counts = lambda r: (delta(r, "misses"), delta(r, "hits"), delta(r, "dropped"))
    mib = 2**20
    # 1.5 MiB mapped fresh, kept when freed; three blocks of 0.25, 0.5 and 0.75 MiB are cut
    # from it, and freed, join again: 1.5 MiB are served whole once more
    assert counts(whole) == (1, 0, 0)
    assert counts(pieces) == (0, 3, 0)
    assert counts(again) == (0, 1, 0)
    # 0.375 MiB take the front of the kept range, which keeps the rest
    assert counts(smaller) == (0, 1, 0)
    assert smaller["during"]["cpu_cache_used_bytes"] == 3 * mib // 8
    assert smaller["during"]["cpu_cache_kept_bytes"] == 3 * mib // 2 - 3 * mib // 8
    # 2 MiB fit in no kept range: the kept memory goes back before they are mapped, and the
    # peak in use rises to them
    assert counts(larger) == (1, 0, 1)
    for r in rounds:
        for key in ("during", "after"):
            c = r[key]
            peak = 2 * mib if r is larger else 3 * mib // 2
            assert (
                c["cpu_cache_used_bytes"] + c["cpu_cache_kept_bytes"] <= c["cpu_cache_bound_bytes"]
            )
            assert c["cpu_cache_bound_bytes"] == peak


# Two 1 MiB blocks freed with a block in use between them: 1.5 MiB, which neither holds, come
# from their pages, moved together.
_JOIN = """
import json, torch
from tessel.runtime import cpu_cache
cpu_cache.install(cpu_cache.library())
mib = 2**18
a, between, b = (torch.full((n,), 1.0) for n in (mib, mib // 4, mib))
del a, b
before = cpu_cache.counts()
joined = torch.full((3 * mib // 2,), 2.0)
print(json.dumps({"sum": joined.sum().item(), "before": before, "during": cpu_cache.counts()}))
"""


@needs_cache
def test_a_request_no_kept_range_holds_is_made_of_the_pages_of_several():
    report = _report(_JOIN)
    assert report["sum"] == 2.0 * (3 * 2**18 // 2)
    before, during = report["before"], report["during"]
    delta = {k.removeprefix("cpu_cache_"): during[k] - before[k] for k in during}
    assert (delta["joins"], delta["misses"], delta["dropped"]) == (1, 0, 0), delta
    mib = 2**20
    assert during["cpu_cache_bound_bytes"] == 2 * mib + mib // 4  # what the first three held
    assert during["cpu_cache_used_bytes"] == 3 * mib // 2 + mib // 4
    assert during["cpu_cache_kept_bytes"] == mib // 2


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
