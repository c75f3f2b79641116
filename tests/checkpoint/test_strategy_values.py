"""Every value a strategy reader accepts is one the converters handle.

A property test draws every numeric field of a parameter's record over the range its reader
accepts (dev_matrix, tensor_map, shape, pipeline stages, opt_shard_size, opt_shard_step, rank
lists; MindSpore's field sizes and stage), in each form strategies come in (tessel's JSON,
MindSpore's JSON and protobuf, a `Strategy` built in memory), and drives the converters: the
box every rank holds, the tiling check, and a small conversion. Each ends in tessel's own error
or in a right answer (the ranks' boxes tile the tensor exactly, each the slice an independent
slicer cuts; the converted files hold those slices), never a raw arithmetic or index error.
And `opt_shard_size: -1` reads as MindSpore means it (the parameter's whole data-parallel
group), or is refused by name where it has no meaning.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from tessel.checkpoint.boxes import check_tiling, device_box, distinct_boxes, intersect, volume
from tessel.checkpoint.mindspore_proto import messages
from tessel.checkpoint.strategy import ParamLayout, Strategy, load_strategy
from tessel.config.fields import MAX_ID
from tessel.errors import TesselError
from tessel.parallel import StrategyError, shard_checkpoint

from .helpers import ref_rank_slices, ref_slice, write_full

MAX_DIM = 2**62  # the largest tensor dim a strategy file may give
SMALL = 16  # up to this many devices a stage, every device's box is computed and checked
FORMATS = ("tessel", "mindspore", "protobuf", "memory")

_sizes = st.sampled_from(
    [1, 1, 2, 2, 2, 2, 2, 3, 3, 4, 4, 65537, MAX_ID]
)  # dev_matrix entries, 1..MAX_ID
_dims = st.sampled_from([0, 1, 2, 3, 4, 6, 8, 12, 24, MAX_DIM])  # tensor dims, 0..MAX_DIM


@st.composite
def _axes(draw, n: int) -> int | list[int]:
    """One tensor_map entry: -1 (not sharded), an axis, or a list of axes, each drawn over the
    reader's range -1..MAX_ID (mostly near the dev_matrix's axes)."""
    axis = st.sampled_from([-1, *range(n), *range(n), n, MAX_ID])
    return draw(st.one_of(axis, axis, st.lists(axis, max_size=2)))


@st.composite
def records(draw) -> tuple[str, list[tuple[str, dict]], dict[str, tuple[int, ...]]]:
    """A form and one or two parameter records sharing a dev_matrix, as plain values; and each
    parameter's full shape (which MindSpore's protobuf does not record)."""
    form = draw(st.sampled_from(FORMATS))
    field = draw(st.sampled_from([0, 0, 0, 0, 0, 1, MAX_ID]))  # MindSpore's field split size
    current = draw(st.sampled_from([0, 1, 1, MAX_ID]))  # MindSpore's save counter
    dev = draw(st.lists(_sizes, min_size=1, max_size=3))
    devices = math.prod(dev)
    stage = draw(st.sampled_from([0, 0, 0, 1, MAX_ID]))
    out, shapes = [], {}
    for name in draw(st.sampled_from([["w"], ["w", "b"]])):
        ndim = draw(st.sampled_from([0, 1, 1, 2, 2, 2]))
        shape = tuple(draw(_dims) for _ in range(ndim))
        stages = draw(st.lists(st.sampled_from([0, 0, 1, 2, MAX_ID]), min_size=1, max_size=2,
                               unique=True))  # fmt: skip
        fields = {
            "dev_matrix": dev,
            "tensor_map": [draw(_axes(len(dev))) for _ in range(ndim)],
            "shape": shape,
            "stages": stages if form in ("tessel", "memory") else [stage],
            "opt_shard_size": draw(st.sampled_from([-1, -1, -1, 0, 0, 0, 1, 2, 2, 3, 4, MAX_ID])),
            "opt_shard_step": draw(st.sampled_from([0, 0, 0, 0, 0, 1, 2, 3, 4, MAX_ID])),
            "field": field,
            "current_stage": current,
        }
        if form in ("tessel", "memory") and devices <= SMALL and draw(st.booleans()):
            fields["rank_list"] = draw(st.permutations(range(2 * devices)))[:devices]
        out.append((name, fields))
        shapes[name] = shape
    return form, out, shapes


def _axes_list(entry: int | list[int]) -> list[int]:
    return entry if isinstance(entry, list) else [entry]


def _tessel_keys(fields: dict) -> dict:
    return {k: v for k, v in fields.items() if k not in ("field", "current_stage")}


def _written(form: str, params: list[tuple[str, dict]], root: Path) -> Path | Strategy:
    """The records in `form`: a file under `root`, or a Strategy object."""
    if form == "memory":
        return Strategy(
            {
                name: ParamLayout(
                    dev_matrix=tuple(f["dev_matrix"]),
                    tensor_map=tuple(
                        tuple(a for a in _axes_list(e) if a != -1) for e in f["tensor_map"]
                    ),
                    shape=f["shape"],
                    dtype="float32",
                    stages=tuple(f["stages"]),
                    opt_shard_size=f["opt_shard_size"],
                    opt_shard_step=f["opt_shard_step"],
                    rank_list=tuple(f["rank_list"]) if "rank_list" in f else None,
                )
                for name, f in params
            },
            "memory",
        )
    if form == "tessel":
        doc = {
            "format": "tessel-strategy",
            "params": {
                name: {**_tessel_keys(f), "shape": list(f["shape"]), "dtype": "float32"}
                for name, f in params
            },
        }
        path = root / "strategy.json"
        path.write_text(json.dumps(doc))
        return path
    if form == "mindspore":
        stage = params[0][1]["stages"][0]
        doc = {
            "current_stage": params[0][1]["current_stage"],
            "parallel_strategy_item": {"op": {"stage": stage, "parallel_strategy": [[1]]}},
            "parallel_layout_item": {
                name: {
                    "dev_matrix": f["dev_matrix"],
                    "tensor_map": f["tensor_map"],
                    "tensor_shape": list(f["shape"]),
                    "field": f["field"],
                    "opt_weight_shard_step": f["opt_shard_step"],
                    "opt_weight_shard_size": f["opt_shard_size"],
                }
                for name, f in params
            },
        }
        path = root / "strategy.json"
        path.write_text(json.dumps(doc))
        return path
    m = messages()["ParallelStrategyMap"](current_stage=params[0][1]["current_stage"])
    item = m.parallel_strategy_item.add(node_name="op")
    item.parallel_strategys.stage = params[0][1]["stages"][0]
    for name, f in params:
        lay = m.parallel_layout_item.add(param_name=name).parallel_layouts
        lay.dev_matrix.add().dim.extend(f["dev_matrix"])
        entries = f["tensor_map"]
        if all(not isinstance(e, list) for e in entries):
            lay.tensor_map.add().dim.extend(entries)
        else:  # MindSpore's nested form: one TensorMap a dim, a 1-dim tensor padded with []
            for e in entries:
                lay.tensor_map.add().dim.extend(_axes_list(e) or [-1])
            if len(entries) == 1:
                lay.tensor_map.add()
        lay.field, lay.opt_weight_shard_step = f["field"], f["opt_shard_step"]
        lay.opt_weight_shard_size = f["opt_shard_size"]
    path = root / "strategy.ckpt"
    path.write_bytes(m.SerializeToString())
    return path


def _check_boxes(name: str, p: ParamLayout, shape: tuple[int, ...], source: str) -> bool:
    """Where the tiling check passes, every device's box lies in the tensor, the distinct ones
    tile it exactly, and each is the slice `ref_slice` cuts; True then. False where tessel
    refuses the layout for this shape (by its own error)."""
    if p.device_num > SMALL:  # each device's box, at the ends and the middle
        for index in {0, 1 % p.device_num, p.device_num // 2, p.device_num - 1}:
            try:
                box = device_box(p, index, shape)
            except StrategyError:
                return False
            assert len(box) == len(shape)
            assert all(0 <= a <= b <= s for (a, b), s in zip(box, shape, strict=True)), box
        return False
    try:
        check_tiling(name, p, source, shape)
    except StrategyError as e:
        assert "\n" not in str(e)
        return False
    boxes = [b for b in distinct_boxes(p, shape) if volume(b)]
    for box in boxes:
        assert all(0 <= a < b <= s for (a, b), s in zip(box, shape, strict=True)), box
    assert sum(volume(b) for b in boxes) == math.prod(shape)
    for i, a in enumerate(boxes):
        assert all(intersect(a, b) is None for b in boxes[i + 1 :]), (a, boxes)
    if math.prod(shape) <= 4096:  # the slice an independent slicer cuts, device by device
        full = torch.arange(math.prod(shape)).reshape(shape)
        for index in range(p.device_num):
            box = device_box(p, index, shape)
            mine = full[tuple(slice(a, b) for a, b in box)]
            assert torch.equal(mine, ref_slice(full, p, index)), (index, box)
    return True


SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@SETTINGS
@given(records())
def test_every_record_a_reader_accepts_converts_right_or_is_refused_by_name(drawn):
    form, params, shapes = drawn
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        written = _written(form, params, root)
        try:
            strategy = load_strategy(written)  # as every converter reads its strategies
        except StrategyError as e:
            assert "\n" not in str(e) and str(e).startswith(
                "memory" if form == "memory" else str(written)
            ), e
            event(f"{form}: refused by the reader")
            return
        assert strategy is not None
        assert strategy.world_size - 1 <= MAX_ID  # ranks are 32-bit ids, as MindSpore's
        tiled = all(
            _check_boxes(name, p, p.shape or shapes[name], strategy.source)
            for name, p in strategy.params.items()
        )
        small = all(math.prod(s) <= 4096 for s in shapes.values())
        event(f"{form}: read, {'tiled' if tiled else 'not tiled'}")
        if not (tiled and small and strategy.world_size <= 8):
            return
        # a small conversion: full tensors sharded by the strategy, each rank's file checked
        full = {
            name: torch.randn(shape, generator=torch.Generator().manual_seed(1))
            for name, shape in shapes.items()
        }
        hf = write_full(full, root / "hf")
        try:
            shard_checkpoint(hf, root / "out", written)
        except TesselError as e:
            assert "\n" not in str(e), e
            event(f"{form}: conversion refused")
            return
        event(f"{form}: converted")
        for rank in range(strategy.world_size):
            want = ref_rank_slices(full, strategy, rank)
            path = root / "out" / f"rank_{rank}" / f"checkpoint_{rank}.safetensors"
            if not want:
                assert not path.exists()
                continue
            got = load_file(str(path))
            assert set(got) == set(want)
            for name in want:
                assert torch.equal(got[name], want[name]), (rank, name)


# ---------------------------------------------------------------------------------------------
# opt_shard_size -1: the whole data-parallel group


def _layout(dev, tm, size=-1, step=0, shape=None) -> ParamLayout:
    return ParamLayout(tuple(dev), tuple(tuple(a) for a in tm), shape, "float32",
                       opt_shard_size=size, opt_shard_step=step)  # fmt: skip


@pytest.mark.parametrize(
    ("dev", "tm", "step", "resolved"),
    [
        ((2, 4), [[0], []], 0, (2, 4)),  # dp 2 outermost, tp 4: stride 4
        ((2, 4), [[0], []], 4, (2, 4)),  # the step MindSpore writes for it
        ((4, 2), [[1], []], 0, (2, 1)),  # dp innermost: stride 1
        ((2, 2, 4), [[0], []], 0, (4, 4)),  # two adjacent dp axes: one group of 4
        ((2, 4, 1), [[1], []], 0, (2, 4)),  # an axis of size 1 holds no replica
        ((2, 1, 2, 3), [[0], []], 0, (4, 3)),  # dp axes with a size-1 axis between
        ((2, 4), [[1, 0], []], 5, (0, 0)),  # no replica: nothing to shard, whatever the step
    ],
)
def test_minus_one_shards_over_the_whole_data_parallel_group(dev, tm, step, resolved):
    """Size -1 reads as the parameter's data-parallel group (every rank holding its slice), as
    MindSpore computes it (`prod(dev_matrix) // prod(tensor_strategy)`), each rank's shard its
    place in that group: the boxes tile the tensor, each the slice MindSpore's stride gives."""
    rows = 48
    p = _layout(dev, tm, step=step, shape=(rows, 4))
    strategy = load_strategy(Strategy({"w": p}, "memory"))
    q = strategy.params["w"]
    assert (q.opt_shard_size, q.opt_shard_step) == resolved
    assert _check_boxes("w", q, (rows, 4), "memory")
    if q.opt_shard_size:  # each rank holds 1/(model-parallel splits x group) of the rows
        for index in range(q.device_num):
            (a, b), _ = device_box(q, index, (rows, 4))
            assert b - a == rows // (q.splits()[0] * q.opt_shard_size)


@pytest.mark.parametrize(
    ("dev", "tm", "step", "key", "words"),
    [
        ((2, 4), [[0], []], 1, "opt_shard_step", "1, but opt_shard_size -1 shards over the "
         "whole data-parallel group, whose 2 ranks lie 4 apart; allowed: 0 (derive it) or 4"),
        ((4, 2), [[1], []], 2, "opt_shard_step", "whose 2 ranks lie 1 apart"),
        ((2, 2, 2), [[1], []], 0, "opt_shard_size", "-1 (the whole data-parallel group), "
         "but the data-parallel device axes [2, 0] of dev_matrix [2, 2, 2] lie apart"),
    ],
)  # fmt: skip
def test_minus_one_that_contradicts_its_step_or_walks_no_stride_is_refused_by_name(
    tmp_path, dev, tm, step, key, words
):
    doc = {
        "format": "tessel-strategy",
        "params": {"w": {"shape": [8, 4], "dev_matrix": list(dev), "tensor_map": tm,
                         "opt_shard_size": -1, "opt_shard_step": step}},
    }  # fmt: skip
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(StrategyError) as refused:
        load_strategy(path)
    text = str(refused.value)
    assert text.startswith(f"{path}: params.w.{key}: is ") and words in text, text


def test_a_record_built_in_memory_is_resolved_before_any_box(tmp_path):
    """A `ParamLayout` with -1 handed to a converter as it is: read as a file's would be."""
    full = {"w": torch.randn(8, 4, generator=torch.Generator().manual_seed(2))}
    strategy = Strategy({"w": _layout((2, 2), [[0], []], step=2)}, "memory")
    shard_checkpoint(write_full(full, tmp_path / "hf"), tmp_path / "out", strategy)
    resolved = load_strategy(strategy)
    assert resolved.params["w"].opt_shard_size == 2
    for rank in range(4):
        got = load_file(str(tmp_path / "out" / f"rank_{rank}" / f"checkpoint_{rank}.safetensors"))
        assert torch.equal(got["w"], ref_rank_slices(full, resolved, rank)["w"])
        assert got["w"].shape == (2, 4)  # a quarter of the rows: tp 2 x the group of 2
    with pytest.raises(StrategyError, match="not resolved to a group size and its step"):
        device_box(_layout((2, 2), [[0], []]), 0, (8, 4))
