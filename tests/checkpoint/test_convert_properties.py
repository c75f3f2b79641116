"""Property tests: random shapes, meshes and layouts through convert / unify / rank lists."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from tessel.checkpoint.boxes import check_tiling
from tessel.checkpoint.errors import StrategyError
from tessel.checkpoint.strategy import ParamLayout, Strategy, check_param, write_strategy
from tessel.parallel import (
    CheckpointError,
    convert_checkpoint_by_rank,
    convert_checkpoints,
    rank_list_for_convert,
    unified_safetensors,
)

from .helpers import files_bytes, make_full, ref_rank_slices, write_sharded

NAMES = ["w", "b", "e", "s"]


@st.composite
def mesh(draw):
    nax = draw(st.integers(1, 3))
    dev = tuple(draw(st.sampled_from([1, 2, 2, 3, 4])) for _ in range(nax))
    assume(math.prod(dev) <= 12)
    stages = draw(st.integers(1, 2))
    return dev, stages


@st.composite
def tensor_map(draw, dev, ndim):
    per_dim: list[list[int]] = [[] for _ in range(ndim)]
    axes = list(range(len(dev)))
    axes = draw(st.permutations(axes))
    for a in axes:
        d = draw(st.integers(-1, ndim - 1)) if ndim else -1
        if d >= 0:
            per_dim[d].append(a)
    return tuple(tuple(x) for x in per_dim)


def _opt_choices(dev, tm):
    p = ParamLayout(dev, tm)
    rep = p.repeat()
    return [k for k in range(2, rep + 1) if rep % k == 0]


@st.composite
def strategy_pair(draw):
    """Two strategies over the same parameter ndims, plus full shapes both divide."""
    (dev_a, stages_a), (dev_b, stages_b) = draw(mesh()), draw(mesh())
    n = draw(st.integers(1, 3))
    out_a, out_b, shapes = {}, {}, {}
    for name in NAMES[:n]:
        ndim = draw(st.integers(0, 2)) if name != "w" else draw(st.integers(1, 2))
        lay = []
        for dev, stages in ((dev_a, stages_a), (dev_b, stages_b)):
            tm = draw(tensor_map(dev, ndim))
            opt = 0
            if ndim and draw(st.booleans()):
                ch = _opt_choices(dev, tm)
                if ch:
                    opt = draw(st.sampled_from(ch))
            stage_list = draw(
                st.lists(st.integers(0, stages - 1), min_size=1, max_size=stages, unique=True)
            )
            p = ParamLayout(dev, tm, stages=tuple(sorted(stage_list)), opt_shard_size=opt)
            try:
                p = check_param(name, p, "t")
            except StrategyError:
                assume(False)
            lay.append(p)
        shape = []
        for d in range(ndim):
            ks = []
            for p in lay:
                k = p.splits()[d] * ((p.opt_shard_size or 1) if d == 0 else 1)
                ks.append(k)
            shape.append(math.lcm(*ks) * draw(st.integers(1, 2)))
        shape = tuple(shape)
        pa, pb = (ParamLayout(**{**p.__dict__, "shape": shape}) for p in lay)
        for p in (pa, pb):
            try:
                check_tiling(name, p, "t")
            except StrategyError:
                assume(False)
        dtype = "bfloat16" if name == "b" else "float32"
        out_a[name] = ParamLayout(**{**pa.__dict__, "dtype": dtype})
        out_b[name] = ParamLayout(**{**pb.__dict__, "dtype": dtype})
        shapes[name] = shape
    return Strategy(out_a, "A"), Strategy(out_b, "B"), shapes


def _full(shapes, sa):
    full = make_full(shapes, seed=1)
    return {k: v.to(getattr(torch, sa.params[k].dtype)) for k, v in full.items()}


def _check_rank_files(d: Path, full, strat: Strategy):
    for r in range(strat.world_size):
        want = ref_rank_slices(full, strat, r)
        f = d / f"rank_{r}" / f"checkpoint_{r}.safetensors"
        if not want:
            assert not f.exists()
            continue
        got = load_file(str(f))
        assert set(got) == set(want)
        for k in want:
            assert got[k].dtype == want[k].dtype
            assert torch.equal(got[k], want[k]), (r, k)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(strategy_pair(), st.sampled_from([1, 1, 2]))
def test_convert_round_trip_unify_and_slices(pair, procs):
    sa, sb, shapes = pair
    full = _full(shapes, sa)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        a_dir, a_file = write_sharded(full, sa, root, "A")
        _check_rank_files(a_dir, full, sa)  # shard_checkpoint gives the reference slices
        b_file = root / "B.json"
        write_strategy(sb, b_file)
        convert_checkpoints(a_dir, root / "B", "checkpoint_", a_file, b_file, process_num=procs)
        _check_rank_files(root / "B", full, sb)  # every destination slice = region of full
        convert_checkpoints(root / "B", root / "A2", "checkpoint_", b_file, a_file)
        assert files_bytes(root / "A2") == files_bytes(a_dir)  # A -> B -> A: same files
        unified_safetensors(root / "B", b_file, root / "U", max_shard_size=64)
        got = {}
        for f in sorted((root / "U").glob("model-*.safetensors")):
            got.update(load_file(str(f)))
        assert set(got) == set(full)
        for k in full:
            assert torch.equal(got[k], full[k])


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(strategy_pair(), st.data())
def test_rank_list_for_convert_is_sufficient_and_minimal(pair, data):
    sa, sb, shapes = pair
    full = _full(shapes, sa)
    rank = data.draw(st.integers(0, sb.world_size - 1))
    assume(sb.params_of_rank(rank))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        a_dir, a_file = write_sharded(full, sa, root, "A")
        b_file = root / "B.json"
        write_strategy(sb, b_file)
        ranks = rank_list_for_convert(rank, a_file, b_file)
        assert ranks == sorted(set(ranks), reverse=True)
        files = {r: str(a_dir / f"rank_{r}" / f"checkpoint_{r}.safetensors") for r in ranks}
        out = root / "out" / "r.safetensors"
        convert_checkpoint_by_rank(rank, files, out, a_file, b_file)
        got = load_file(str(out))
        want = ref_rank_slices(full, sb, rank)
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k])
        for r in ranks:  # no rank can be left out
            fewer = {q: f for q, f in files.items() if q != r}
            with pytest.raises(CheckpointError):
                convert_checkpoint_by_rank(
                    rank, fewer, root / "x" / "r.safetensors", a_file, b_file
                )
        assert not (root / "x").exists()
