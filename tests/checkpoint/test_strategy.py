"""Strategy files: tessel JSON, MindSpore JSON and protobuf, merge, group info."""

from __future__ import annotations

import json

import pytest
import torch

from tessel.checkpoint.mindspore_proto import messages, strategy_to_protobuf, write_group_info
from tessel.checkpoint.strategy import load_strategy
from tessel.parallel import (
    Layout,
    StrategyError,
    build_searched_strategy,
    merge_pipeline_strategys,
    rank_list_for_convert,
    restore_group_info_list,
    save_strategy_file,
)


def _proto_file(tmp_path):
    """A MindSpore strategy file built with the node_strategy.proto message classes."""
    M = messages()
    m = M["ParallelStrategyMap"](current_stage=3)
    item = m.parallel_strategy_item.add(node_name="Default/MatMul-op0")
    item.parallel_strategys.stage = 1
    item.parallel_strategys.parallel_strategy.add().dim.extend([2, 4])
    # plain tensor map: w split on dim 0 by axis 1 (dev dim 0, size 2); optimizer shard
    it = m.parallel_layout_item.add(param_name="w")
    lay = it.parallel_layouts
    lay.dev_matrix.add().dim.extend([2, 4])
    lay.tensor_map.add().dim.extend([0, -1])
    lay.field, lay.opt_weight_shard_step, lay.opt_weight_shard_size = 0, 4, 2
    # nested tensor map (Layout with a tuple entry) on a 1-dim tensor, padded with an empty map
    it = m.parallel_layout_item.add(param_name="b")
    lay = it.parallel_layouts
    lay.dev_matrix.add().dim.extend([2, 4])
    lay.tensor_map.add().dim.extend([0, 1])
    lay.tensor_map.add()
    lay.field, lay.opt_weight_shard_step, lay.opt_weight_shard_size = 0, 0, 0
    p = tmp_path / "strategy.ckpt"
    p.write_bytes(m.SerializeToString())
    return p


def test_read_mindspore_protobuf(tmp_path):
    got = build_searched_strategy(str(_proto_file(tmp_path)))
    w, b = got["w"], got["b"]
    assert w.dev_matrix == (2, 4) and w.tensor_map == ((0,), ())
    assert (w.opt_shard_size, w.opt_shard_step) == (2, 4)
    assert w.stages == (1,) and w.shape is None
    assert b.tensor_map == ((0, 1),)


def test_protobuf_opt_shard_minus_one_resolves_to_replica_count(tmp_path):
    M = messages()
    m = M["ParallelStrategyMap"](current_stage=1)
    lay = m.parallel_layout_item.add(param_name="w").parallel_layouts
    lay.dev_matrix.add().dim.extend([4, 2])
    lay.tensor_map.add().dim.extend([0, -1])
    lay.field, lay.opt_weight_shard_step, lay.opt_weight_shard_size = 0, 2, -1
    p = tmp_path / "s.ckpt"
    p.write_bytes(m.SerializeToString())
    assert build_searched_strategy(str(p))["w"].opt_shard_size == 4


def test_merged_protobuf_stage_prefixes(tmp_path):
    lay = Layout((2,), ("tp",))
    st = save_strategy_file(
        tmp_path / "s.json",
        {
            "emb": (lay("tp", "None"), (4, 2), "float32", {"stage": [0, 1]}),
            "w1": (lay("None", "tp"), (4, 2), "float32", {"stage": 1}),
        },
    )
    raw = strategy_to_protobuf(st)
    p = tmp_path / "merged.ckpt"
    p.write_bytes(raw)
    back = load_strategy(p)
    assert back.params["emb"].stages == (0, 1) and back.params["w1"].stages == (1,)
    assert back.world_size == 4


def test_tessel_json_round_trip(tmp_path):
    lay = Layout((2, 2), ("dp", "tp"))
    path = tmp_path / "s.json"
    st = save_strategy_file(
        path,
        {
            "w": (lay(("tp", "dp"), "None"), (8, 4), torch.bfloat16),
            "v": (lay("None", "tp"), (8, 4), "float32", {"opt_shard_size": 2, "stage": 0}),
        },
    )
    data = json.loads(path.read_text())
    assert data["format"] == "tessel-strategy" and data["stage_device_num"] == 4
    assert data["params"]["w"]["tensor_map"] == [[0, 1], []]
    assert data["params"]["w"]["dtype"] == "bfloat16"
    assert data["params"]["v"]["opt_shard_step"] == 2
    back = load_strategy(path)
    assert back.params == st.params


def test_mindspore_json(tmp_path):
    data = {
        "current_stage": 1,
        "parallel_strategy_item": {"op": {"stage": 0, "parallel_strategy": [[2, 1]]}},
        "parallel_layout_item": {
            "w": {
                "dev_matrix": [2, 4],
                "tensor_map": [1, -1],
                "tensor_shape": [8, 4],
                "field": 0,
                "opt_weight_shard_step": 0,
                "opt_weight_shard_size": 0,
            }
        },
    }
    p = tmp_path / "ms.json"
    p.write_text(json.dumps(data))
    w = load_strategy(p).params["w"]
    assert w.shape == (8, 4) and w.tensor_map == ((1,), ())


def test_merge_pipeline_strategys(tmp_path):
    lay = Layout((2,), ("tp",))
    d = tmp_path / "stages"
    d.mkdir()
    save_strategy_file(
        d / "s0.json",
        {
            "emb": (lay("tp", "None"), (4, 2), "float32", {"stage": 0}),
            "w0": (lay("None", "tp"), (4, 2), "float32", {"stage": 0}),
        },
    )
    (d / "s0_copy.json").write_bytes((d / "s0.json").read_bytes())  # a second rank of stage 0
    save_strategy_file(
        d / "s1.json",
        {
            "emb": (lay("tp", "None"), (4, 2), "float32", {"stage": 1}),
            "w1": (lay("None", "tp"), (4, 2), "float32", {"stage": 1}),
        },
    )
    merged = merge_pipeline_strategys(str(d), tmp_path / "merged.json")
    assert merged.params["emb"].stages == (0, 1)
    assert set(merged.params) == {"emb", "w0", "w1"}
    assert load_strategy(tmp_path / "merged.json").world_size == 4


def test_merge_rejects_mixed_formats(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "b.ckpt").write_bytes(b"x")
    with pytest.raises(StrategyError, match="mixes"):
        merge_pipeline_strategys(str(tmp_path), tmp_path / "out.json")


def test_restore_group_info_list(tmp_path):
    p = tmp_path / "group_info.pb"
    p.write_bytes(write_group_info({"dp-group": [0, 4], "tp-group": [0, 1, 2, 3]}, [0, 4]))
    assert restore_group_info_list(str(p)) == [0, 4]
    (tmp_path / "empty.pb").write_bytes(b"")
    with pytest.raises(StrategyError, match="empty"):
        restore_group_info_list(str(tmp_path / "empty.pb"))


@pytest.mark.parametrize(
    "payload, words",
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b'{"format": "tessel-strategy", "params": {"w": {"dev_matrix": [2]}}}', "tensor_map"),
        (
            b'{"format": "tessel-strategy", "params": {"w": {"dev_matrix": [2], "tensor_map": [[3]]}}}',
            "outside",
        ),
        (
            b'{"format": "tessel-strategy", "params": {"w": {"dev_matrix": [2], "tensor_map": [[0]],'
            b' "dtype": "float13"}}}',
            "float13",
        ),
        (b'{"format": "tessel-strategy", "params": {}}', "no sliced parameter"),
        (b'{"something": 1}', "neither"),
        (b"\xff\xff\xff", "protobuf"),
    ],
)
def test_bad_strategy_files(tmp_path, payload, words):
    p = tmp_path / ("s.json" if payload[:1] in (b"{", b"") else "s.ckpt")
    p.write_bytes(payload)
    with pytest.raises(StrategyError, match=words) as e:
        load_strategy(p)
    assert str(p) in str(e.value)


def test_missing_strategy_file(tmp_path):
    with pytest.raises(StrategyError, match="does not exist"):
        load_strategy(tmp_path / "nope.json")


def test_save_strategy_rejects_bad_opt_and_keeps_uneven_splits_out_of_mindspore(tmp_path):
    from tessel.checkpoint.boxes import device_box
    from tessel.checkpoint.mindspore_proto import strategy_to_protobuf

    lay = Layout((4,), ("tp",))
    save_strategy_file(tmp_path / "s.json", {"w": (lay("tp"), (6,), "float32")})
    st = load_strategy(tmp_path / "s.json")
    # torch.chunk's cut, as DTensor's Shard: 2, 2, 2 and an empty last slice
    boxes = [device_box(st.params["w"], i, (6,)) for i in range(4)]
    assert boxes == [((0, 2),), ((2, 4),), ((4, 6),), ((6, 6),)]
    with pytest.raises(StrategyError, match="splits unevenly into 4 slices"):
        strategy_to_protobuf(st)
    lay2 = Layout((2, 2), ("dp", "tp"))
    with pytest.raises(StrategyError, match="opt_shard_size"):
        save_strategy_file(
            tmp_path / "s.json", {"w": (lay2("tp"), (8,), "float32", {"opt_shard_size": 3})}
        )
    with pytest.raises(StrategyError, match="unknown options"):
        save_strategy_file(tmp_path / "s.json", {"w": (lay2("tp"), (8,), "float32", {"x": 1})})


def test_disagreeing_device_counts(tmp_path):
    with pytest.raises(StrategyError, match="per-stage device count"):
        save_strategy_file(
            tmp_path / "s.json",
            {
                "a": (Layout((2,), ("x",))("x"), (4,), "float32"),
                "b": (Layout((4,), ("x",))("x"), (4,), "float32"),
            },
        )


def test_rank_list_without_files_from_protobuf(tmp_path):
    src = _proto_file(tmp_path)
    lay = Layout((8,), ("tp",))
    save_strategy_file(tmp_path / "dst.json", {"w": (lay("None", "tp"), None, None)})
    # dst rank 0 needs all rows of w. In the source (stage 1, ranks 8..15) w's dim 0 is split 4
    # ways by the last device axis and each piece is optimizer-sharded 2 ways across the dp axis
    # (step 4), so all 8 slices are distinct and each is held by exactly one rank.
    got = rank_list_for_convert(0, str(src), str(tmp_path / "dst.json"))
    assert got == list(range(15, 7, -1))
    # dst with w split on dim 0 by 8: rank 3 needs rows 3/8 only -> the single source rank whose
    # slice (piece 1 of 4, opt half 1) holds them: local index 4*1 + 1 -> global 8 + 5
    save_strategy_file(tmp_path / "dst2.json", {"w": (lay("tp", "None"), None, None)})
    assert rank_list_for_convert(3, str(src), str(tmp_path / "dst2.json")) == [13]
    assert rank_list_for_convert(0, None, str(tmp_path / "dst.json")) == [0]


def _tessel_file(**changes) -> dict:
    w = {"shape": [8, 4], "dtype": "float32", "dev_matrix": [2, 2], "tensor_map": [[1], []]}
    w.update(changes)
    return {"format": "tessel-strategy", "version": 1, "params": {"w": w}}


def _mindspore_file(**changes) -> dict:
    w = {
        "dev_matrix": [2, 4],
        "tensor_map": [1, -1],
        "tensor_shape": [8, 4],
        "field": 0,
        "opt_weight_shard_step": 0,
        "opt_weight_shard_size": 0,
    }
    w.update(changes)
    return {"current_stage": 1, "parallel_layout_item": {"w": w}}


@pytest.mark.parametrize(
    "data, key, words",
    [
        (_tessel_file(opt_shard_size="2"), "params.w.opt_shard_size", "found string '2'"),
        (_tessel_file(opt_shard_size=2**63), "params.w.opt_shard_size", "allowed: -1.."),
        (_tessel_file(dev_matrix=[2**63]), "params.w.dev_matrix[0]", "allowed: 1..2147483647"),
        (_tessel_file(dev_matrix=[2, True]), "params.w.dev_matrix[1]", "found boolean true"),
        (_tessel_file(stages=[-1]), "params.w.stages[0]", "found number -1"),
        (_tessel_file(stages=[0, 0]), "params.w.stages", "lists 0 twice"),
        (_tessel_file(tensor_map=["0", []]), "params.w.tensor_map[0]", "found string '0'"),
        (_tessel_file(dtype="float13"), "params.w.dtype", "'float13' is unknown"),
        (_tessel_file(dev_matrx=[2]), "params.w.dev_matrx", "did you mean 'dev_matrix'?"),
        (_tessel_file(rank_list=[0, 1, 1, 2]), "params.w.rank_list", "lists 1 twice"),
        (
            _tessel_file(alias_name=["tp", "tp"]),
            "params.w.alias_name",
            "aliases must be unique",
        ),
        (
            {**_tessel_file(), "version": 2},
            "version",
            "found number 2; tessel reads version 1",
        ),
        ({**_tessel_file(), "world_size": 2}, "world_size", "allowed: 4..2147483647"),
        ({**_tessel_file(), "parms": {}}, "parms", "did you mean 'params'?"),
        (
            _mindspore_file(opt_weight_shard_size="0"),
            "parallel_layout_item.w.opt_weight_shard_size",
            "found string '0'",
        ),
        (_mindspore_file(field=1), "parallel_layout_item.w.field", "uses field split"),
        (
            _mindspore_file(tensor_shap=[8, 4]),
            "parallel_layout_item.w.tensor_shap",
            "did you mean 'tensor_shape'?",
        ),
        (
            {**_mindspore_file(), "parallel_strategy_item": {"op": {"stage": -1}}},
            "parallel_strategy_item.op.stage",
            "found number -1",
        ),
        ({"paralel_layout_item": {}}, "paralel_layout_item", "did you mean 'parallel_layout_item'"),
    ],
)
def test_strategy_files_refuse_nonsense(tmp_path, data, key, words):
    p = tmp_path / "s.json"
    p.write_text(json.dumps(data))
    with pytest.raises(StrategyError) as e:
        load_strategy(p)
    assert str(e.value).startswith(f"{p}: ") and key in str(e.value) and words in str(e.value)


def test_unreadable_strategy_files_are_strategy_errors(tmp_path):
    with pytest.raises(StrategyError, match="NUL"):
        load_strategy(str(tmp_path / "a\x00b.json"))
    with pytest.raises(StrategyError, match="cannot read the strategy file"):
        load_strategy(tmp_path / ("x" * 300 + ".json"))
    p = tmp_path / "huge.json"
    p.write_text('{"format": "tessel-strategy", "version": ' + "9" * 5000 + "}")
    with pytest.raises(StrategyError, match="not valid JSON"):
        load_strategy(p)


def test_protobuf_records_get_the_same_bounds(tmp_path):
    M = messages()
    m = M["ParallelStrategyMap"](current_stage=1)
    lay = m.parallel_layout_item.add(param_name="w").parallel_layouts
    lay.dev_matrix.add().dim.extend([65536, 65536])
    lay.tensor_map.add().dim.extend([0, -1])
    lay.field, lay.opt_weight_shard_step, lay.opt_weight_shard_size = 0, 0, 0
    p = tmp_path / "s.ckpt"
    p.write_bytes(m.SerializeToString())
    with pytest.raises(StrategyError, match=r"params.w.dev_matrix: \[65536, 65536\] makes more"):
        load_strategy(p)
