"""MindSpore's Layout (device matrix, alias names, tensor maps, interleaving) and Layout <->
DTensor placements."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tessel.checkpoint.boxes import device_box
from tessel.checkpoint.strategy import param_from_layout
from tessel.config.errors import ConfigError
from tessel.parallel import (
    Layout,
    LayoutError,
    NotExpressibleError,
    layout_from_dtensor,
    layout_to_dtensor,
    layout_to_placements,
)


def test_docstring_example_tensor_map():
    lay = Layout((2, 2, 2), ("dp", "sp", "mp"))
    d = lay("dp", "mp").to_dict()
    assert d["tensor_map"] == (2, 0)
    assert d["device_matrix"] == (2, 2, 2)
    assert d["alias_name"] == ("dp", "sp", "mp")
    assert d["interleaved_parallel"] is False
    assert d["rank_list"] == list(range(8))


def test_none_and_tuple_entries():
    lay = Layout((2, 2, 2), ("dp", "sp", "mp"))
    assert lay("None", ("sp", "dp")).to_dict()["tensor_map"] == (-1, (1, 2))


def test_tuple_first_alias_is_outer_index_docs_figure():
    # MS docs figure: Layout((2,2,2),("dp","sp","mp"))("mp",("sp","dp")) on a 2x4 tensor puts
    # columns a0..a3 on ranks 0, 4, 2, 6.
    lay = Layout((2, 2, 2), ("dp", "sp", "mp"))("mp", ("sp", "dp"))
    p = param_from_layout("x", lay, (2, 4), "float32")
    col_of = {}
    for r in range(8):
        box = device_box(p, r, (2, 4))
        if box[0] == (0, 1):
            col_of.setdefault(box[1][0], r)
    assert [col_of[c] for c in range(4)] == [0, 4, 2, 6]


def test_row_major_rank_coordinates():
    lay = Layout((2, 4), ("dp", "tp"))("dp", "tp")
    p = param_from_layout("x", lay, (2, 4), "float32")
    # rank 5 = coordinate (1, 1): row 1, column 1
    assert device_box(p, 5, (2, 4)) == ((1, 2), (1, 2))


def test_call_returns_copy_and_rank_list():
    base = Layout((2, 2), ("a", "b"), rank_list=[3, 2, 1, 0])
    one = base("a", "b")
    assert base.tensor_map is None and one.tensor_map == (1, 0)
    assert one.to_dict()["rank_list"] == [3, 2, 1, 0]


def test_interleaved_parallel_flag():
    lay = Layout((2, 2), ("dp", "interleaved_parallel"))
    assert lay("dp", "interleaved_parallel").to_dict()["interleaved_parallel"] is True
    with pytest.raises(NotExpressibleError):
        layout_to_placements(lay("dp", "None"))


@pytest.mark.parametrize(
    "args, key, words",
    [
        (([2, 2], ("a", "b")), "device_matrix", "tuple"),
        (((2, 2), ["a", "b"]), "alias_name", "tuple"),
        (((2, 2), ("a",)), "alias_name", "same length"),
        (((2, "x"), ("a", "b")), "device_matrix", "int"),
        (((2, 2), ("a", 1)), "alias_name", "str"),
        (((2, 2), ("a", "None")), "alias_name", "'None'"),
        (((2, 2), ("a", "")), "alias_name", "empty"),
        (((2, 2), ("a", "a")), "alias_name", "unique"),
        (((2, 2), ("interleaved_parallel", "a")), "alias_name", "last"),
        (((2, 2), ("a", "b"), [0, 1, 2]), "rank_list", "prod(device_matrix)"),
        (((2, 2), ("a", "b"), [[0, 1], [2, 3]]), "rank_list", "1-D"),
        (((), ()), "device_matrix", "is empty"),
        (((2,), ("t p",)), "alias_name", "letters, digits and underscores"),
        (((10**12,), ("tp",)), "device_matrix", "at most"),
    ],
)
def test_constructor_validation(args, key, words):
    with pytest.raises((LayoutError, TypeError)) as e:
        Layout(*args)
    assert isinstance(e.value, ConfigError) and e.value.key == key and words in str(e.value)


def test_type_errors_are_type_errors():
    with pytest.raises(TypeError):
        Layout([2], ("a",))


@pytest.mark.parametrize(
    "entries, words",
    [
        (("a", "a"), "used twice"),
        (("c",), "not in alias_name"),
        ((("a", "None"),), "'None'"),
        ((3,), "alias"),
        (((),), "empty"),
    ],
)
def test_tensor_map_validation(entries, words):
    with pytest.raises(LayoutError, match=words):
        Layout((2, 2), ("a", "b"))(*entries)


def test_to_dict_requires_tensor_map():
    with pytest.raises(LayoutError, match="tensor_map"):
        Layout((2,), ("a",)).to_dict()


def test_placements_plain_and_strided():
    lay = Layout((2, 2), ("dp", "tp"))
    assert layout_to_placements(lay("dp", "tp")) == [Shard(0), Shard(1)]
    assert layout_to_placements(lay("None", "tp")) == [Replicate(), Shard(1)]
    # dp outer, tp inner: mesh order -> plain Shard on both
    assert layout_to_placements(lay(("dp", "tp"), "None")) == [Shard(0), Shard(0)]
    # tp outer (FSDP2 + TP): dp needs _StridedShard(split_factor=tp size)
    assert layout_to_placements(lay(("tp", "dp"), "None")) == [
        _StridedShard(0, split_factor=2),
        Shard(0),
    ]


def test_dtensor_round_trip_and_mesh():
    lay = Layout((2, 3, 2), ("a", "b", "c"), rank_list=list(range(11, -1, -1)))
    for tm in [("a", ("c", "b")), (("c", "a", "b"), "None"), ("None", ("b", "a", "c"))]:
        x = lay(*tm)
        mesh, pl = layout_to_dtensor(x)
        assert tuple(mesh.shape) == (2, 3, 2) and mesh.mesh_dim_names == ("a", "b", "c")
        assert mesh.mesh.flatten().tolist() == list(range(11, -1, -1))
        back = layout_from_dtensor(mesh, pl, 2)
        assert back == x


def test_from_dtensor_rejects_partial_and_bad_split_factor():
    from torch.distributed.tensor import Partial

    with pytest.raises(NotExpressibleError, match="Partial|no Layout"):
        layout_from_dtensor((2, 2), [Partial(), Shard(0)], 1)
    with pytest.raises(NotExpressibleError, match="split_factor 3"):
        layout_from_dtensor((2, 2), [_StridedShard(0, split_factor=3), Shard(0)], 1)


ALIASES = ("x", "y", "z")
MESHES_3D = [(2, 2, 2), (2, 3, 2), (2, 2, 3)]


def _all_tensor_maps(aliases=ALIASES) -> list[tuple]:
    """Every 2-dim tensor map over the aliases: each alias on dim 0, dim 1 or unused, and the
    aliases on one dim in every order (so every permutation of 2- and 3-alias tuples)."""
    out = []
    for bins in itertools.product(range(3), repeat=len(aliases)):
        on = [[a for a, b in zip(aliases, bins, strict=True) if b == d] for d in (0, 1)]
        for p0 in itertools.permutations(on[0]):
            for p1 in itertools.permutations(on[1]):
                out.append(tuple("None" if not p else p[0] if len(p) == 1 else p for p in (p0, p1)))
    return out


def test_all_tensor_maps_cover_every_ordering():
    maps = _all_tensor_maps()
    tuples = {e for tm in maps for e in tm if isinstance(e, tuple)}
    assert len(maps) == 49 and len(set(maps)) == 49
    assert {t for t in tuples if len(t) == 3} == set(itertools.permutations(ALIASES))
    assert {t for t in tuples if len(t) == 2} == set(itertools.permutations(ALIASES, 2))


@pytest.mark.parametrize("dev", MESHES_3D)
def test_placements_round_trip_every_ordering(dev):
    base = Layout(dev, ALIASES)
    for tm in _all_tensor_maps():
        lay = base(*tm)
        assert layout_from_dtensor(dev, layout_to_placements(lay), 2, ALIASES) == lay, tm


def test_wrong_placements_are_refused_naming_the_layout(monkeypatch):
    """If the placements ever disagree with the Layout's slices, the answer is an error."""
    import tessel.checkpoint.dtensor as dt

    monkeypatch.setattr(dt, "_split_factor", lambda dev, mesh_dims, i: 1)  # plain Shard only
    lay = Layout((2, 3, 2), ALIASES)("None", ("z", "x", "y"))
    with pytest.raises(NotExpressibleError, match=r"tensor dim 1 by \('z', 'x', 'y'\)") as e:
        layout_to_placements(lay)
    assert repr(lay) in str(e.value) and e.value.key == "tensor_map[1]"
    # mesh-order splits need no _StridedShard, so they are still accepted
    assert layout_to_placements(Layout((2, 3, 2), ALIASES)(("x", "y"), "z")) == [
        Shard(0),
        Shard(0),
        Shard(1),
    ]


def test_placements_match_torch_distribute_tensor():
    """DTensor's own sharding of the placements equals the Layout's slices on every rank, for
    every ordering of the axes of 3-axis device matrices; DCP's offsets agree too."""
    code = textwrap.dedent(
        f"""
        import math, torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import distribute_tensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        from tessel.parallel import Layout, layout_to_placements
        from tessel.checkpoint.boxes import device_box
        from tessel.checkpoint.strategy import param_from_layout
        shape = (24, 24)
        full = torch.arange(24 * 24).view(shape)
        bad, checked = [], 0
        for dev in {MESHES_3D!r}:
            n = math.prod(dev)
            base = Layout(dev, {ALIASES!r})
            for r in range(n):
                dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=n)
                mesh = DeviceMesh("cpu", torch.arange(n).view(dev))
                for tm in {_all_tensor_maps()!r}:
                    lay = base(*tm)
                    pl = layout_to_placements(lay)
                    local = distribute_tensor(full, mesh, pl, src_data_rank=None).to_local()
                    box = device_box(param_from_layout("t", lay, shape, "int64"), r, shape)
                    want = full[tuple(slice(a, b) for a, b in box)]
                    size, off = compute_local_shape_and_global_offset(shape, mesh, pl)
                    ok = torch.equal(local, want) and tuple(off) == tuple(a for a, _ in box)
                    if not ok:
                        bad.append((dev, tm, r))
                    checked += 1
                dist.destroy_process_group()
        print("CHECKED", checked, "BAD", len(bad), bad[:5])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "CHECKED 1568 BAD 0 " in out.stdout, out.stdout + out.stderr


def test_load_distributed_checkpoint_into_dtensor_params(tmp_path):
    """A module whose parameters are DTensors gets exactly its local shards."""
    from safetensors.torch import save_file

    full = {"w": torch.arange(48.0).view(8, 6), "b": torch.arange(8.0)}
    (tmp_path / "hf").mkdir()
    save_file(full, str(tmp_path / "hf" / "model.safetensors"))
    code = textwrap.dedent(
        f"""
        import torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import distribute_tensor, Shard
        from torch.distributed.tensor.placement_types import _StridedShard
        from tessel.parallel import load_distributed_checkpoint
        full = {{"w": torch.arange(48.0).view(8, 6), "b": torch.arange(8.0)}}
        bad = 0
        for r in range(4):
            dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=4)
            mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
            net = torch.nn.Module()
            pl = {{"w": [Shard(1), Shard(0)], "b": [_StridedShard(0, split_factor=2), Shard(0)]}}
            for k, v in full.items():
                d = distribute_tensor(torch.zeros_like(v), mesh, pl[k], src_data_rank=None)
                net.register_parameter(k, torch.nn.Parameter(d))
            load_distributed_checkpoint(net, unified_safetensors_dir={str(tmp_path / "hf")!r})
            for k, v in full.items():
                want = distribute_tensor(v, mesh, pl[k], src_data_rank=None).to_local()
                bad += not torch.equal(getattr(net, k).to_local(), want)
            dist.destroy_process_group()
        print("BAD", bad)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "BAD 0" in out.stdout, out.stdout + out.stderr
