"""MindSpore protobuf strategy and group-info files, read without protoc or MindSpore.

The message classes of ``node_strategy.proto`` (package ``mindspore.straspb``, proto2) are built at
runtime from a FileDescriptorProto that this module writes field by field, then turned into
Python classes with ``google.protobuf.message_factory``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from tessel.checkpoint.errors import StrategyError
from tessel.checkpoint.records import ParamLayout, Strategy, check_param, merge_stage_prefixed

_F = descriptor_pb2.FieldDescriptorProto
_REQ, _REP = _F.LABEL_REQUIRED, _F.LABEL_REPEATED
_U32, _I32, _I64, _STR, _MSG = (
    _F.TYPE_UINT32,
    _F.TYPE_INT32,
    _F.TYPE_INT64,
    _F.TYPE_STRING,
    _F.TYPE_MESSAGE,
)
PACKAGE = "mindspore.straspb"

# message name -> [(field name, number, label, type, message type name or None)]
_SCHEMA: dict[str, list[tuple[str, int, int, int, str | None]]] = {
    "ParallelStrategy": [("dim", 1, _REP, _U32, None)],
    "ParallelStrategys": [
        ("stage", 1, _REQ, _U32, None),
        ("parallel_strategy", 2, _REP, _MSG, "ParallelStrategy"),
    ],
    "ParallelStrategyItem": [
        ("node_name", 1, _REQ, _STR, None),
        ("parallel_strategys", 2, _REQ, _MSG, "ParallelStrategys"),
    ],
    "DevMatrix": [("dim", 1, _REP, _U32, None)],
    "TensorMap": [("dim", 1, _REP, _I32, None)],
    "ParamSplitShape": [("dim", 1, _REP, _I64, None)],
    "IndicesOffset": [("dim", 1, _REP, _I64, None)],
    "ParallelLayouts": [
        ("dev_matrix", 1, _REP, _MSG, "DevMatrix"),
        ("tensor_map", 2, _REP, _MSG, "TensorMap"),
        ("param_split_shape", 3, _REP, _MSG, "ParamSplitShape"),
        ("indices_offset", 4, _REP, _MSG, "IndicesOffset"),
        ("field", 5, _REQ, _I32, None),
        ("opt_weight_shard_step", 6, _REQ, _I32, None),
        ("opt_weight_shard_size", 7, _REQ, _I32, None),
    ],
    "ParallelLayoutItem": [
        ("param_name", 1, _REQ, _STR, None),
        ("parallel_layouts", 2, _REQ, _MSG, "ParallelLayouts"),
    ],
    "ParallelGroupRanks": [("dim", 1, _REP, _U32, None)],
    "ParallelGroupItem": [
        ("group_name", 1, _REQ, _STR, None),
        ("parallel_group_ranks", 2, _REQ, _MSG, "ParallelGroupRanks"),
    ],
    "ParallelGroupMap": [
        ("parallel_group_item", 1, _REP, _MSG, "ParallelGroupItem"),
        ("ckpt_restore_rank_list", 2, _REQ, _MSG, "ParallelGroupRanks"),
    ],
    "ParallelStrategyMap": [
        ("current_stage", 1, _REQ, _U32, None),
        ("parallel_strategy_item", 2, _REP, _MSG, "ParallelStrategyItem"),
        ("parallel_layout_item", 3, _REP, _MSG, "ParallelLayoutItem"),
    ],
}


@lru_cache(maxsize=1)
def messages() -> dict[str, Any]:
    """The node_strategy.proto message classes, by message name."""
    fdp = descriptor_pb2.FileDescriptorProto(
        name="tessel_node_strategy.proto", package=PACKAGE, syntax="proto2"
    )
    for msg_name, fields in _SCHEMA.items():
        m = fdp.message_type.add(name=msg_name)
        for fname, num, label, ftype, tname in fields:
            f = m.field.add(name=fname, number=num, label=label, type=ftype)
            if tname:
                f.type_name = f".{PACKAGE}.{tname}"
            if ftype in (_U32, _I32, _I64) and label == _REP:
                f.options.packed = False  # proto2 default: unpacked
    pool = descriptor_pool.DescriptorPool()
    fd = pool.Add(fdp)
    del fd
    out = {}
    for msg_name in _SCHEMA:
        desc = pool.FindMessageTypeByName(f"{PACKAGE}.{msg_name}")
        out[msg_name] = message_factory.GetMessageClass(desc)
    return out


def _parse(kind: str, raw: bytes, src: str) -> Any:
    msg = messages()[kind]()
    try:
        msg.ParseFromString(raw)
    except DecodeError as e:
        raise StrategyError(src, None, f"is not a MindSpore {kind} protobuf file: {e}") from None
    return msg


def strategy_from_protobuf(raw: bytes, src: str) -> Strategy:
    """Read a serialised ParallelStrategyMap into a Strategy (shape and dtype left unknown)."""
    msg = _parse("ParallelStrategyMap", raw, src)
    stage = 0
    if msg.parallel_strategy_item:
        stage = int(msg.parallel_strategy_item[0].parallel_strategys.stage)
    pairs = []
    for item in msg.parallel_layout_item:
        name = item.param_name
        lay = item.parallel_layouts
        if not lay.dev_matrix:
            raise StrategyError(
                src,
                f"params.{name}",
                "has no dev_matrix (a pipeline-only strategy cannot be converted)",
            )
        if lay.param_split_shape and list(lay.param_split_shape[0].dim):
            raise StrategyError(
                src, f"params.{name}", "uses a manual uneven split (param_split_shape)"
            )
        if lay.field:
            raise StrategyError(src, f"params.{name}", f"uses field split (field={lay.field})")
        maps = [list(t.dim) for t in lay.tensor_map]
        if len(maps) == 1:
            tm = tuple(() if a == -1 else (a,) for a in maps[0])
        else:  # one TensorMap per dim (nested layout); MindSpore pads 1-dim tensors with []
            maps = [m for m in maps if m]
            tm = tuple(tuple(a for a in m if a != -1) for m in maps)
        p = ParamLayout(
            dev_matrix=tuple(int(d) for d in lay.dev_matrix[0].dim),
            tensor_map=tm,
            stages=(stage,),
            opt_shard_size=int(lay.opt_weight_shard_size),
            opt_shard_step=int(lay.opt_weight_shard_step),
        )
        pairs.append((name, check_param(name, p, src)))
    return Strategy(merge_stage_prefixed(pairs, src, prefixed=True), src)


def strategy_to_protobuf(strategy: Strategy, stage: int | None = None) -> bytes:
    """Serialise a Strategy as a MindSpore ParallelStrategyMap (for MindSpore users and tests).

    Params of several stages get MindSpore's ``"{stage}-"`` name prefix, as in a merged file.
    """
    msgs = messages()
    m = msgs["ParallelStrategyMap"](current_stage=1)
    stages = sorted({s for p in strategy.params.values() for s in p.stages})
    merged = stage is None and len(stages) > 1
    if not merged:
        item = m.parallel_strategy_item.add(node_name="Default/tessel")
        item.parallel_strategys.stage = stages[0] if stage is None else stage
    for name, p in strategy.params.items():
        for d, (size, k) in enumerate(zip(p.shape or (), p.splits())):
            if size % k:
                raise StrategyError(
                    strategy.source,
                    f"params.{name}",
                    f"dim {d} of size {size} splits unevenly into {k} slices, which MindSpore's "
                    "strategy format cannot express",
                )
        for s in p.stages if merged else (p.stages[0],):
            it = m.parallel_layout_item.add(param_name=f"{s}-{name}" if merged else name)
            lay = it.parallel_layouts
            lay.dev_matrix.add().dim.extend(p.dev_matrix)
            if all(len(a) <= 1 for a in p.tensor_map):
                lay.tensor_map.add().dim.extend([a[0] if a else -1 for a in p.tensor_map])
            else:
                for a in p.tensor_map:
                    lay.tensor_map.add().dim.extend(list(a) or [-1])
                if len(p.tensor_map) == 1:
                    lay.tensor_map.add()
            lay.field = 0
            lay.opt_weight_shard_step = p.opt_shard_step
            lay.opt_weight_shard_size = p.opt_shard_size
    return m.SerializeToString()


def read_group_info(raw: bytes, src: str) -> list[int]:
    """``ckpt_restore_rank_list`` of a serialised ParallelGroupMap."""
    msg = _parse("ParallelGroupMap", raw, src)
    if not msg.HasField("ckpt_restore_rank_list") or not msg.ckpt_restore_rank_list.dim:
        raise StrategyError(src, "ckpt_restore_rank_list", "is missing or empty")
    return [int(r) for r in msg.ckpt_restore_rank_list.dim]


def write_group_info(groups: dict[str, list[int]], restore_ranks: list[int]) -> bytes:
    """Serialise a ParallelGroupMap (used by tests and by users who build one by hand)."""
    m = messages()["ParallelGroupMap"]()
    for name, ranks in groups.items():
        it = m.parallel_group_item.add(group_name=name)
        it.parallel_group_ranks.dim.extend(ranks)
    m.ckpt_restore_rank_list.dim.extend(restore_ranks)
    return m.SerializeToString()
