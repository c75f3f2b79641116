"""Converting real rank files whose source strategy is a MindSpore protobuf file (no shapes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessel.checkpoint.mindspore_proto import messages
from tessel.checkpoint.strategy import ParamLayout, Strategy, load_strategy
from tessel.parallel import (
    Layout,
    convert_checkpoint_by_rank,
    convert_checkpoints,
    rank_list_for_convert,
    save_strategy_file,
    unified_safetensors,
)

from .helpers import load_rank, make_full, ref_rank_slices

DEV = (2, 4)  # MindSpore device matrix: dev dim 0 (size 2, axis 1), dev dim 1 (size 4, axis 0)
SHAPES = {"w": (16, 8), "emb": (32, 6), "b": (8,), "norm": (4, 4)}

# name -> (tensor map as written to the protobuf file, right-numbered axes per dim, opt size, step)
PROTO = {
    "w": ([[1, 0]], ((1,), (0,)), 0, 0),
    "emb": ([[0, -1]], ((0,), ()), 2, 4),  # dim 0 split 4 ways, each piece opt-sharded over dp
    "b": ([[0, 1], []], ((0, 1),), 0, 0),  # nested map on a 1-dim tensor, padded as MindSpore does
    "norm": ([[-1, -1]], ((), ()), 0, 0),
}


Stages = dict[str, tuple[int, ...]]


def _write_proto(path: Path, stages: Stages) -> Path:
    """A node_strategy.proto ParallelStrategyMap; a merged (multi-stage) file prefixes names with
    ``"{stage}-"`` as MindSpore's merge does."""
    m = messages()["ParallelStrategyMap"](current_stage=1)
    merged = len({s for ss in stages.values() for s in ss}) > 1
    if not merged:
        item = m.parallel_strategy_item.add(node_name="Default/MatMul-op0")
        item.parallel_strategys.stage = next(iter(stages.values()))[0]
        item.parallel_strategys.parallel_strategy.add().dim.extend(list(DEV))
    for name, (maps, _, size, step) in PROTO.items():
        for s in stages[name]:
            it = m.parallel_layout_item.add(param_name=f"{s}-{name}" if merged else name)
            lay = it.parallel_layouts
            lay.dev_matrix.add().dim.extend(list(DEV))
            for tm in maps:
                lay.tensor_map.add().dim.extend(tm)
            lay.field, lay.opt_weight_shard_step, lay.opt_weight_shard_size = 0, step, size
    path.write_bytes(m.SerializeToString())
    return path


def _expected_strategy(stages: Stages) -> Strategy:
    """The same layouts written by hand (with shapes), for the independent reference slicer."""
    params = {
        n: ParamLayout(DEV, tm, SHAPES[n], None, stages[n], size, step)
        for n, (_, tm, size, step) in PROTO.items()
    }
    return Strategy(params, "<expected>")


def _write_rank_files(full: dict, st: Strategy, root: Path) -> Path:
    """Per-rank safetensors files cut by ``helpers.ref_slice`` (not by tessel's converter)."""
    for r in range(st.world_size):
        part = {k: v.contiguous() for k, v in ref_rank_slices(full, st, r).items()}
        if not part:
            continue  # ranks of an earlier stage that hold none of these parameters
        (root / f"rank_{r}").mkdir(parents=True)
        save_file(part, str(root / f"rank_{r}" / f"checkpoint_{r}.safetensors"))
    return root


def _dst_strategy(path: Path) -> Path:
    lay = Layout((4,), ("tp",))
    save_strategy_file(
        path,
        {
            "w": (lay("None", "tp"), None, None),
            "emb": (lay("tp", "None"), None, None),
            "b": (lay("tp"), None, None),
            "norm": (lay("None", "None"), None, None),
        },
    )
    return path


STAGINGS = {
    "one-stage": dict.fromkeys(PROTO, (0,)),
    "stage-1-only": dict.fromkeys(PROTO, (1,)),
    "merged-shared": dict.fromkeys(PROTO, (0, 1)),
    "merged-pipeline": {"w": (0,), "b": (0,), "emb": (1,), "norm": (0, 1)},
}


@pytest.fixture(params=list(STAGINGS))
def proto_ckpt(request, tmp_path):
    stages = STAGINGS[request.param]
    full = make_full(SHAPES, seed=11, dtype=None)  # alternating float32 / bfloat16
    src = _write_rank_files(full, _expected_strategy(stages), tmp_path / "src")
    return full, src, _write_proto(tmp_path / "strategy.ckpt", stages), stages


def test_protobuf_source_layouts_read_as_written(proto_ckpt):
    _, _, proto, stages = proto_ckpt
    st = load_strategy(proto)
    for n, (_, tm, size, step) in PROTO.items():
        p = st.params[n]
        assert (p.dev_matrix, p.tensor_map, p.stages) == (DEV, tm, stages[n]), n
        assert (p.opt_shard_size, p.opt_shard_step) == (size, step), n


def test_convert_checkpoints_from_protobuf_strategy(proto_ckpt, tmp_path):
    full, src, proto, _ = proto_ckpt
    dst_file = _dst_strategy(tmp_path / "dst.json")
    convert_checkpoints(src, tmp_path / "out", "ckpt_", proto, dst_file)
    dst = load_strategy(dst_file)
    for r in range(4):
        got = load_rank(tmp_path / "out", r, "ckpt_")
        want = ref_rank_slices(full, dst, r)
        assert set(got) == set(SHAPES)
        for k in SHAPES:
            assert got[k].dtype == full[k].dtype, (r, k)
            assert torch.equal(got[k], want[k]), (r, k)


def test_convert_checkpoints_from_protobuf_to_unsharded(proto_ckpt, tmp_path):
    full, src, proto, _ = proto_ckpt
    convert_checkpoints(src, tmp_path / "out", "full_", proto, None)
    got = load_rank(tmp_path / "out", 0, "full_")
    assert set(got) == set(full)
    for k, v in full.items():
        assert torch.equal(got[k], v), k


def test_unified_safetensors_from_protobuf_strategy(proto_ckpt, tmp_path):
    full, src, proto, _ = proto_ckpt
    unified_safetensors(src, proto, tmp_path / "hf", max_shard_size=600)
    got: dict[str, torch.Tensor] = {}
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 1
    for f in shards:
        got.update(load_file(str(f)))
    assert set(got) == set(full)
    for k, v in full.items():
        assert torch.equal(got[k], v), k


def test_convert_checkpoint_by_rank_from_protobuf(proto_ckpt, tmp_path):
    full, src, proto, _ = proto_ckpt
    dst_file = _dst_strategy(tmp_path / "dst.json")
    dst = load_strategy(dst_file)
    for r in range(4):
        need = rank_list_for_convert(r, proto, dst_file)
        files = {s: src / f"rank_{s}" / f"checkpoint_{s}.safetensors" for s in need}
        out = tmp_path / "byrank" / f"rank_{r}.safetensors"
        convert_checkpoint_by_rank(r, files, out, proto, dst_file)
        got = load_file(str(out))
        want = ref_rank_slices(full, dst, r)
        for k in SHAPES:
            assert torch.equal(got[k], want[k]), (r, k)


def test_protobuf_strategy_as_destination_round_trip(proto_ckpt, tmp_path):
    """proto -> TP4 -> proto gives back every source rank's slices."""
    full, src, proto, stages = proto_ckpt
    dst_file = _dst_strategy(tmp_path / "dst.json")
    convert_checkpoints(src, tmp_path / "tp4", "ckpt_", proto, dst_file)
    convert_checkpoints(tmp_path / "tp4", tmp_path / "back", "checkpoint_", dst_file, proto)
    expected = _expected_strategy(stages)
    for r in range(expected.world_size):
        want = ref_rank_slices(full, expected, r)
        if not want:
            assert not (tmp_path / "back" / f"rank_{r}").exists()
            continue
        got = load_rank(tmp_path / "back", r)
        assert set(got) == set(want), r
        for k, v in want.items():
            assert torch.equal(got[k], v), (r, k)
