"""Layout semantics (MindSpore reference §3) and Layout <-> DTensor placements."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tessel.config.errors import ConfigError
from tessel.parallel import (
    Layout,
    LayoutError,
    NotExpressibleError,
    layout_from_dtensor,
    layout_to_dtensor,
    layout_to_placements,
)
from tessel.parallel.boxes import device_box
from tessel.parallel.strategy import param_from_layout


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


def test_placements_match_torch_distribute_tensor():
    """DTensor's own sharding of the placements equals the Layout's slices on every rank."""
    code = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import distribute_tensor
        from tessel.parallel import Layout, layout_to_placements
        from tessel.parallel.boxes import device_box
        from tessel.parallel.strategy import param_from_layout
        base = Layout((2, 2, 3), ("x", "y", "z"))
        cases = [("x", ("z", "y")), (("z", "x", "y"), "None"), (("y", "x"), "z"),
                 (("z", "y", "x"), "None"), ("None", ("x", "z"))]
        full = torch.arange(24 * 12).view(24, 12)
        bad = 0
        for r in range(12):
            dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=12)
            mesh = DeviceMesh("cpu", torch.arange(12).view(2, 2, 3))
            for tm in cases:
                lay = base(*tm)
                local = distribute_tensor(full, mesh, layout_to_placements(lay),
                                          src_data_rank=None).to_local()
                box = device_box(param_from_layout("t", lay, (24, 12), "int64"), r, (24, 12))
                want = full[tuple(slice(a, b) for a, b in box)]
                bad += not torch.equal(local, want)
            dist.destroy_process_group()
        print("BAD", bad)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "BAD 0" in out.stdout, out.stdout + out.stderr


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
