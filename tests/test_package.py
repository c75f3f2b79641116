"""The offline model file: refused when truncated, altered, of an unknown version, or loaded wrongly.

A package is read as untrusted input: every tampered package here has its checksums recomputed,
so what refuses it is the check meant for it, and it is always a `PackageError` or a
`ProgramError`, never a raw exception.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import small_gpt2, small_llama, token_ids
from tests.json_edits import replaced

import tessel
from tessel.lower.program import ProgramError
from tessel.package import Package, PackageError
from tessel.package.format import MANIFEST
from tessel.package.manifest import Manifest


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("pkg")
    model = small_llama(layers=1)
    ids = token_ids()
    partitioned = tessel.save(tessel.build(model, (ids,), cluster=2), d / "tp2")
    single = tessel.save(tessel.build(model, (ids,), cluster=1, graph_parallel=False), d / "single")
    return model, ids, partitioned, single


def _rewrite(src, dst, edit):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            zout.writestr(item.filename, edit(item.filename, zin.read(item.filename)))


def _tamper(
    src: Path,
    dst: Path,
    members: dict[str, Callable[[bytes], bytes]] | None = None,
    manifest: Callable[[dict], Any] | None = None,
    manifest_text: Callable[[str], str] | None = None,
) -> Path:
    """Rewrite a package with edited members and manifest, checksums recomputed to match."""
    members = members or {}
    with zipfile.ZipFile(src) as zin:
        data = {n: zin.read(n) for n in zin.namelist()}
    m = json.loads(data.pop(MANIFEST))
    for name, edit in members.items():
        data[name] = edit(data[name])
    m["files"] = {n: hashlib.sha256(d).hexdigest() for n, d in data.items()}
    if manifest is not None:
        edited = manifest(m)
        m = m if edited is None else edited
    text = json.dumps(m)
    if manifest_text is not None:
        text = manifest_text(text)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for name, d in data.items():
            zout.writestr(name, d)
        zout.writestr(MANIFEST, text)
    return dst


def _edit_program(edit: Callable[[dict], None]) -> Callable[[bytes], bytes]:
    def apply(data: bytes) -> bytes:
        program = json.loads(data)
        edit(program)
        return json.dumps(program).encode()

    return apply


def _first_input(program: dict) -> str:
    return next(n["name"] for n in program["nodes"] if n["op"] == "input")


def _insert_calls(program: dict, *calls: dict) -> None:
    """Put calls just before the first call, so they run before anything else."""
    at = next(i for i, n in enumerate(program["nodes"]) if n["op"] == "call")
    program["nodes"][at:at] = [{"op": "call", "kwargs": {}, **c} for c in calls]


def test_manifest_records_what_a_loader_needs(built):
    _, _, path, _ = built
    m = Package.open(path).manifest
    assert m.format_version == 2 and m.torch_version == torch.__version__
    assert m.mesh.shape == (2,) and len(m.submodels) == 2
    assert [s.rank for s in m.submodels] == [0, 1]
    assert m.to_json() == json.loads(zipfile.ZipFile(path).read(MANIFEST))
    assert Manifest.from_json(m.to_json(), "again") == m  # the JSON form reads back the same
    layouts = Package.open(path).json(m.layouts)
    assert all({"shape", "dtype", "placements"} <= set(v) for v in layouts.values())
    Package.open(path).verify()


def test_truncated_file_is_refused(built, tmp_path):
    _, _, path, _ = built
    cut = tmp_path / "cut.tessel"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(PackageError, match="truncated"):
        Package.open(cut)


def test_altered_member_fails_its_checksum(built, tmp_path):
    _, _, path, _ = built
    bad = tmp_path / "bad.tessel"

    target = next(n for n in zipfile.ZipFile(path).namelist() if n.startswith("weights/"))

    def flip(name, data):
        if name == target:
            data = bytearray(data)
            data[-1] ^= 0xFF
            return bytes(data)
        return data

    _rewrite(path, bad, flip)
    with pytest.raises(PackageError, match=f"{target}' fails its checksum"):
        Package.open(bad).verify()


def test_unknown_format_version_is_refused(built, tmp_path):
    _, _, path, _ = built
    future = tmp_path / "future.tessel"

    def bump(name, data):
        if name == MANIFEST:
            m = json.loads(data)
            m["format_version"] = 99
            return json.dumps(m).encode()
        return data

    _rewrite(path, future, bump)
    with pytest.raises(PackageError, match="format version 99 is not supported"):
        Package.open(future)


def _from_file_then_fill(target: Path) -> Callable[[dict], None]:
    def edit(program: dict) -> None:
        _insert_calls(
            program,
            {"name": "f", "target": "aten.from_file.default", "args": [str(target), True, 16]},
            {"name": "g", "target": "aten.fill_.Scalar", "args": [{"$node": "f"}, 7]},
        )

    return edit


def _copy_into_weight(program: dict) -> None:
    w = _first_input(program)
    _insert_calls(
        program,
        {"name": "z", "target": "aten.zeros_like.default", "args": [{"$node": w}]},
        {"name": "c", "target": "aten.copy_.default", "args": [{"$node": w}, {"$node": "z"}]},
    )


def _call(target: str, args: list, kwargs: dict | None = None) -> Callable[[dict], None]:
    def edit(program: dict) -> None:
        w = _first_input(program)
        filled = [{"$node": w} if a == "$w" else a for a in args]
        _insert_calls(program, {"name": "x", "target": target, "args": filled})
        program["nodes"][next(i for i, n in enumerate(program["nodes"]) if n.get("name") == "x")][
            "kwargs"
        ] = kwargs or {}

    return edit


def _rename_first_input(name: str) -> Callable[[dict], None]:
    def edit(program: dict) -> None:
        old = _first_input(program)
        text = json.dumps(program).replace(f'"{old}"', json.dumps(name))
        program.clear()
        program.update(json.loads(text))

    return edit


def _set_float(literal: Any) -> Callable[[dict], None]:
    def edit(program: dict) -> None:
        _insert_calls(
            program,
            {"name": "x", "target": "aten.scalar_tensor.default", "args": [{"$float": literal}]},
        )

    return edit


@pytest.mark.parametrize(
    "edit, words",
    [
        (_call("builtins.eval.default", ["1"]), "'builtins.eval.default', which is not on"),
        (_copy_into_weight, "copy_.default writes into its argument 'self', which is the prog"),
        (_call("aten.bernoulli.p", ["$w", 0.5]), "'aten.bernoulli.p', which is not on"),
        (_call("aten.add.out", ["$w", "$w"]), "'aten.add.out', which is not on"),
        (_call("aten.neg.default", ["$w"], {"x=__import__('os')": 1}), "no keyword argument"),
        (_call("aten.neg.default", ["$w", 1, 2]), "takes at most 1 arguments"),
        (_rename_first_input('x"); import os; ("'), "invalid name"),
        (_set_float("1e400"), "unknown value"),
        (_set_float([]), "unknown value"),
        (_call("aten.neg.default", [{"$node": "later"}]), "'later' is used before it is defined"),
        (lambda p: p["nodes"].pop(), "program has no output node"),
        (lambda p: p.update(format="tessel.program/9"), "unknown program format"),
    ],
    ids=[
        "eval",
        "copy_into_weight",
        "random_op",
        "out_variant",
        "kwarg_injection",
        "extra_args",
        "name_injection",
        "bad_float",
        "float_list",
        "undefined_node",
        "no_output",
        "format",
    ],
)
def test_tampered_program_is_refused(built, tmp_path, edit, words):
    _, _, _, single = built
    program = Package.open(single).submodel(0).program
    evil = _tamper(single, tmp_path / "evil.tessel", {program: _edit_program(edit)})
    Package.open(evil).verify()  # the checksums match: only the program check can refuse it
    with pytest.raises(ProgramError, match=words):
        tessel.load_model(evil)


def test_program_cannot_write_a_file(built, tmp_path):
    _, _, _, single = built
    target = tmp_path / "written_by_the_program"
    program = Package.open(single).submodel(0).program
    evil = _tamper(
        single, tmp_path / "evil.tessel", {program: _edit_program(_from_file_then_fill(target))}
    )
    with pytest.raises(ProgramError, match="'aten.from_file.default', which is not on"):
        tessel.load_model(evil)
    assert not target.exists()


def _program(*calls: dict, out: str) -> dict:
    return {
        "format": "tessel.program/1",
        "nodes": [
            {"op": "input", "name": "w"},
            {"op": "input", "name": "x"},
            *({"op": "call", "kwargs": {}, **c} for c in calls),
            {"op": "output", "args": [{"$node": out}]},
        ],
    }


def test_no_allowed_operator_writes_touches_files_or_draws_random_numbers():
    from tessel.lower.operators import ALLOWED, IN_PLACE

    for name in sorted(ALLOWED):
        ns, packet, overload = name.split(".")
        op = getattr(getattr(getattr(torch.ops, ns), packet), overload)
        schema = op._schema
        writes = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        if name in IN_PLACE:  # writes only into its first argument, which check() confines
            assert writes == [schema.arguments[0].name], name
            continue
        assert not schema.is_mutable and not writes, name
        assert not any(w in name for w in ("file", "storage", "save", "load", "set_", "_copy_from"))
        if "scaled_dot_product" not in name:  # attention is tagged for its dropout, left at 0
            assert torch.Tag.nondeterministic_seeded not in op.tags, name


def test_writes_into_inputs_or_their_views_are_refused(monkeypatch):
    """Were an in-place operator ever allowed, it could write only into the program's own
    temporaries: never into an input (a weight), a view of one, or through `_unsafe_view`."""
    from tessel.lower import program as prog
    from tessel.lower.program import check, decode

    monkeypatch.setattr(prog, "ALLOWED", prog.ALLOWED | {"aten.copy_.default"})
    copy = lambda dst, name="c": {  # noqa: E731
        "name": name,
        "target": "aten.copy_.default",
        "args": [{"$node": dst}, {"$node": "x"}],
    }
    view = lambda target, name="v": {  # noqa: E731
        "name": name,
        "target": target,
        "args": [{"$node": "w"}, [4]],
    }
    for bad in (
        _program(copy("w"), out="c"),
        _program(view("aten.view.default"), copy("v"), out="c"),
        _program(view("aten._unsafe_view.default"), copy("v"), out="c"),
        _program(
            {"name": "s", "target": "aten.split.Tensor", "args": [{"$node": "w"}, 2]},
            {"name": "g", "target": "getitem", "args": [{"$node": "s"}, 0]},
            copy("g"),
            out="c",
        ),
    ):
        with pytest.raises(
            ProgramError, match="writes into its argument 'self'.*program input 'w'"
        ):
            check(bad)
    fresh = _program(
        {"name": "t", "target": "aten.clone.default", "args": [{"$node": "w"}]},
        copy("t"),
        out="t",
    )
    w, x = torch.zeros(4), torch.arange(4.0)
    (out,) = decode(fresh, {}, torch.device("cpu"), {})(w, x)
    assert torch.equal(out, x) and torch.equal(w, torch.zeros(4))


def test_build_refuses_an_operator_not_on_the_list():
    from torch import fx

    from tessel.lower.program import encode

    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.exponential.default, (x,))
    graph.output([y])
    with pytest.raises(
        ProgramError,
        match="node 'exponential_default' calls 'aten.exponential.default', which is not",
    ):
        encode(fx.GraphModule(torch.nn.Module(), graph))


def test_single_device_path_refuses_a_distributed_model(built):
    model, ids, path, single = built
    with pytest.raises(
        PackageError, match="built for distributed deployment.*load it in a session"
    ):
        tessel.load_model(path)
    (out,) = tessel.load_model(single)(ids)
    with torch.no_grad():
        assert (out - model(ids)).abs().max().item() <= 1e-5


def test_save_is_atomic(built, tmp_path, monkeypatch):
    from tessel.package import format as fmt

    target = tmp_path / "keep.tessel"
    target.write_bytes(b"earlier output")

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(fmt.os, "replace", fail)
    _, _, _, single = built
    package = Package.open(single)
    members = {name: package.read(name) for name in package.manifest.files}
    with pytest.raises(OSError):
        fmt.write_package(target, package.manifest, members)
    assert target.read_bytes() == b"earlier output"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.tessel"]


def test_a_manifest_that_disagrees_with_its_members_is_not_written(built, tmp_path):
    from tessel.package import format as fmt

    _, _, _, single = built
    package = Package.open(single)
    members = {name: package.read(name) for name in package.manifest.files}
    members.pop(package.manifest.layouts)
    with pytest.raises(PackageError, match="manifest layouts: names the member 'layouts.json'"):
        fmt.write_package(tmp_path / "x", package.manifest.to_json(), members)
    with pytest.raises(PackageError, match="names members that are not written: .'layouts.json'"):
        fmt.write_package(tmp_path / "x", package.manifest, members)
    assert list(tmp_path.iterdir()) == []


def test_package_carries_a_strategy_file_for_checkpoint_tools(built, tmp_path):
    from tessel.parallel import load_strategy

    _, _, path, _ = built
    package = Package.open(path)
    target = tmp_path / "strategy.json"
    target.write_bytes(package.read(package.manifest.strategy))
    strategy = load_strategy(target)
    layouts = package.json(package.manifest.layouts)
    assert set(strategy.params) == set(layouts)
    for name, layout in layouts.items():
        p = strategy.params[name]
        assert list(p.shape) == layout["shape"]
        sharded_dims = [d for d, axes in enumerate(p.tensor_map) if axes]
        expected = [int(x[2:-1]) for x in layout["placements"] if x.startswith("S(")]
        assert sharded_dims == expected


def test_programs_call_device_neutral_attention(built):
    """Tracing on CPU picks the CPU flash kernel; programs must carry the device-neutral op so a
    package built for CUDA or NPU devices runs there."""
    _, _, path, single = built
    for pkg in (path, single):
        package = Package.open(pkg)
        for sub in package.manifest.submodels:
            targets = [n.get("target") for n in package.json(sub.program)["nodes"]]
            assert "aten.scaled_dot_product_attention.default" in targets
            assert not [t for t in targets if t and t.endswith("_for_cpu.default")]


def test_cpu_only_kernel_is_refused_on_another_device():
    from tessel.lower.program import decode

    program = {
        "format": "tessel.program/1",
        "nodes": [
            {"op": "input", "name": "q"},
            {
                "op": "call",
                "name": "attn",
                "target": "aten._scaled_dot_product_flash_attention_for_cpu.default",
                "args": [{"$node": "q"}, {"$node": "q"}, {"$node": "q"}],
                "kwargs": {},
            },
            {"op": "output", "args": [{"$node": "attn"}]},
        ],
    }
    program["nodes"][-1:] = [
        {
            "op": "call",
            "name": "out",
            "target": "getitem",
            "args": [{"$node": "attn"}, 0],
            "kwargs": {},
        },
        {"op": "output", "args": [{"$node": "out"}]},
    ]
    q = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    (out,) = decode(program, {}, torch.device("cpu"), {})(q)
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert out.shape == expected.shape and torch.allclose(out, expected, atol=1e-5)
    with pytest.raises(ProgramError, match="'attn' calls the CPU-only kernel.*cannot run on meta"):
        decode(program, {}, torch.device("meta"), {})


def _mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "flag": torch.tensor([True, False, True]),  # 3 bytes: what follows is misaligned
        "w": torch.randn(5, 7, generator=g),
        "h": torch.randn(3, generator=g).to(torch.bfloat16),
        "ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }


def test_weights_stream_out_and_load_back_as_the_safetensors_library_reads_them(tmp_path):
    import io

    from safetensors.torch import load, save

    from tessel.package.safetensors_io import read_tensors, write_safetensors

    def streamed(data: bytes) -> dict[str, torch.Tensor]:
        return read_tensors(io.BytesIO(data), len(data), hashlib.sha256())

    tensors = _mixed_tensors()
    out = io.BytesIO()
    write_safetensors(out, tensors)
    ours = bytearray(out.getvalue())
    for read in (
        load(bytes(ours)),
        streamed(bytes(ours)),
        streamed(save(tensors)),
    ):
        assert read.keys() == tensors.keys()
        for k, t in tensors.items():
            assert read[k].dtype == t.dtype and torch.equal(read[k], t), k


def test_each_tensor_is_read_into_memory_of_its_own_and_every_byte_hashed() -> None:
    import io

    from tessel.package.safetensors_io import read_tensors, write_safetensors

    tensors = _mixed_tensors()
    out = io.BytesIO()
    write_safetensors(out, tensors)
    data = out.getvalue()
    digest = hashlib.sha256()
    read = read_tensors(io.BytesIO(data), len(data), digest)
    assert digest.hexdigest() == hashlib.sha256(data).hexdigest()
    for name, tensor in read.items():
        if tensor.numel():  # no view of a buffer the whole file was read into
            assert tensor.untyped_storage().nbytes() == tensor.nbytes, name


def test_safetensors_whose_tensors_overlap_are_refused() -> None:
    import io

    from tessel.package.safetensors_io import SafetensorsFormatError, read_tensors

    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    data = len(raw).to_bytes(8, "little") + raw + bytes(12)
    with pytest.raises(SafetensorsFormatError, match="overlaps the tensor before it") as err:
        read_tensors(io.BytesIO(data), len(data), hashlib.sha256())
    assert err.value.name == "b"


def test_corrupt_weights_header_names_the_member(built, tmp_path):
    import hashlib

    _, _, path, _ = built
    bad = tmp_path / "header.tessel"
    target = next(n for n in zipfile.ZipFile(path).namelist() if n.startswith("weights/"))
    files = {}

    def break_header(name, data):
        if name == target:  # claim one byte too many for the first tensor
            n = int.from_bytes(data[:8], "little")
            header = json.loads(data[8 : 8 + n])
            first = next(k for k in header if k != "__metadata__")
            header[first]["data_offsets"][1] += 1
            raw = json.dumps(header).encode()
            raw += b" " * (-len(raw) % 8)
            data = len(raw).to_bytes(8, "little") + raw + data[8 + n :]
        if name != MANIFEST:
            files[name] = hashlib.sha256(data).hexdigest()
        return data

    _rewrite(path, bad, break_header)
    manifest = json.loads(zipfile.ZipFile(bad).read(MANIFEST))
    manifest["files"] = files  # checksums that match: only the header check can catch it
    _rewrite(
        bad,
        tmp_path / "resigned.tessel",
        lambda n, d: json.dumps(manifest).encode() if n == MANIFEST else d,
    )
    package = Package.open(tmp_path / "resigned.tessel")
    with pytest.raises(
        PackageError, match=f"member '{target}' is not valid safetensors: header says"
    ):
        package.tensors(target)


def test_tied_weights_are_stored_once_and_load_as_each_rank_needs(tmp_path):
    from torch.distributed.tensor import Replicate, Shard

    from tessel.sharding.placements import local_shard

    model = small_gpt2(layers=1)  # lm_head.weight is wte.weight
    path = tessel.save(tessel.build(model, (token_ids(),), cluster=2), tmp_path / "gpt2")
    pkg = Package.open(path)
    members = [n for n in zipfile.ZipFile(path).namelist() if n.startswith("weights/")]
    stored = [k for m in members for k in pkg.tensors(m)]
    assert len(stored) == len(set(stored))
    layouts = pkg.json(pkg.manifest.layouts)
    wte = model.lm.transformer.wte.weight.detach()
    ties = [s.tied for s in pkg.manifest.submodels]
    assert all(len(t) == 1 for t in ties), ties
    for rank, sub in enumerate(pkg.manifest.submodels):
        (name,) = sub.tied
        assert name not in stored
        placements = tuple(
            Shard(int(p[2:-1])) if p.startswith("S(") else Replicate()
            for p in layouts[name]["placements"]
        )
        assert torch.equal(pkg.weights(sub)[name], local_shard(wte, placements, (2,), rank))


def test_writing_back_while_saving_leaves_the_same_file(built, tmp_path, monkeypatch):
    """Packages go to disk in steps while written; flushing every few KiB changes no byte."""
    from tessel.package import format as package_format

    model, ids, path, _ = built
    syncs = []
    real = package_format._WriteBack.finish

    def finish(self):
        syncs.append(self.raw.tell())
        real(self)

    monkeypatch.setattr(package_format._WriteBack, "STEP", 4096)
    monkeypatch.setattr(package_format._HashingWriter, "_PIECE", 65536)
    monkeypatch.setattr(package_format._WriteBack, "finish", finish)
    pkg = Package.open(path)
    names = [n for n in zipfile.ZipFile(path).namelist() if n != MANIFEST]
    members = {name: pkg.read(name) for name in names}  # in the order they were written
    manifest = {k: v for k, v in pkg.manifest.to_json().items() if k != "files"}
    again = package_format.write_package(tmp_path / "again", manifest, members)
    assert len(syncs) > 5 and syncs[-1] == again.stat().st_size
    Package.open(again).verify()
    with zipfile.ZipFile(path) as before, zipfile.ZipFile(again) as after:
        assert after.namelist() == before.namelist()
        assert all(after.read(n) == before.read(n) for n in names)


def _drop(key: str) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        del m[key]

    return edit


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def edit(m: dict) -> None:
        *parents, last = path.split("/")
        for p in parents:
            m = m[int(p)] if isinstance(m, list) else m[p]
        if isinstance(m, list):
            m[int(last)] = value
        else:
            m[last] = value

    return edit


@pytest.mark.parametrize(
    "manifest, text, words",
    [
        (lambda m: [m], None, "manifest: expected an object, found"),
        (_drop("submodels"), None, "manifest: has no 'submodels'"),
        (_set("world_size", "two"), None, "manifest world_size: expected an integer, found 'two'"),
        (_set("world_size", 0), None, "world_size: found 0; the least allowed is 1"),
        (_set("world_size", 3), None, "manifest mesh: a partitioned model on 3 devices needs"),
        (_set("submodels/1/rank", 0), None, r"submodels\[1\].rank: expected 1"),
        (_set("submodels/0/program", "programs/none.json"), None, "which the package does not"),
        (_set("submodels/0/weights", ["../../etc/passwd"]), None, "is not a valid member name"),
        (_set("submodels/0/comm_groups", [[0, 5]]), None, "the most allowed is 1"),
        (_set("inputs/0/shape", [2, -16]), None, r"inputs\[0\].shape\[1\]: found -16"),
        (_set("inputs/0/dtype", "float128"), None, "found 'float128'; allowed: bfloat16"),
        (_set("mode", "clustered"), None, "mode: found 'clustered'; allowed: partitioned"),
        (_set("plan/ranks", "many"), None, "plan.ranks: expected a list"),
        (_set("files/layouts.json", "00"), None, "expected a SHA-256"),
        (_set("memory", {"peak": 1}), None, "manifest: unknown key 'memory'"),
        (_set("submodels/1/extra", 1), None, r"submodels\[1\]: unknown key 'extra'"),
        (None, lambda t: t.replace('"world_size": 2', '"world_size": NaN'), "NaN is not a JSON"),
        (None, lambda t: t.replace('"world_size": 2', '"world_size": 2.0'), "expected an integer"),
        (None, lambda t: t.replace('"world_size": 2', '"world_size": 2.5.1'), "not valid JSON"),
        (None, lambda t: t.replace('"world_size": 2', '"world_size": 1e999'), "expected an int"),
        (None, lambda t: t.replace('"world_size": 2', '"world_size": ' + "9" * 5000), "not valid"),
        (None, lambda t: t.replace('"estimated_time_s": ', '"estimated_time_s": 1e999 +'), "JSON"),
        (None, lambda t: t[:-1], "manifest is not valid JSON"),
        (None, lambda t: "[" * 100000 + "]" * 100000, "manifest is not valid JSON"),
    ],
    ids=lambda v: None if callable(v) or v is None else str(v)[:40],
)
def test_tampered_manifest_is_refused(built, tmp_path, manifest, text, words):
    _, _, path, _ = built
    bad = _tamper(path, tmp_path / "bad.tessel", manifest=manifest, manifest_text=text)
    with pytest.raises(PackageError, match=words):
        Package.open(bad)


def _with_claimed_size(path: Path, member: str, size: int) -> None:
    """Make the zip directory say `member` holds `size` bytes (zip64 sizes, as a big file has)."""
    data = bytearray(path.read_bytes())
    end = len(data) - 22
    cd_size, cd_offset = struct.unpack("<II", data[end + 12 : end + 20])
    directory, out, i = data[cd_offset : cd_offset + cd_size], bytearray(), 0
    while i < len(directory):
        n, m, k = struct.unpack("<HHH", directory[i + 28 : i + 34])
        entry = bytearray(directory[i : i + 46 + n + m + k])
        if entry[46 : 46 + n].decode() == member:
            entry[20:28] = b"\xff" * 8  # sizes are in the zip64 extra field
            extra = struct.pack("<HHQQ", 1, 16, size, size)
            entry[30:32] = struct.pack("<H", m + len(extra))
            entry[46 + n + m : 46 + n + m] = extra
        out += entry
        i += 46 + n + m + k
    data[cd_offset:] = out + data[end:]
    data[-10:-6] = struct.pack("<I", len(out))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("member", ["weights/replicated.safetensors", MANIFEST])
def test_a_member_claiming_more_bytes_than_the_file_is_refused_before_reading(
    built, tmp_path, member
):
    _, _, _, single = built
    bad = _tamper(single, tmp_path / "big.tessel")
    _with_claimed_size(bad, member, 10**15)
    with pytest.raises(PackageError, match=f"member '{member}' claims {10**15} bytes"):
        Package.open(bad)


def test_random_inputs_larger_than_the_memory_are_refused_before_any_is_made(built, tmp_path):
    from tessel.config.errors import ConfigError
    from tessel.runtime.cli_run import random_inputs

    _, _, _, single = built

    def huge(m: dict) -> None:
        m["inputs"][0]["shape"] = [10**7, 10**7]

    bad = _tamper(single, tmp_path / "huge.tessel", manifest=huge)
    with pytest.raises(ConfigError, match=r"--inputs: random inputs .* take [\d,]+ bytes; this"):
        random_inputs(Package.open(bad).manifest)


def _raw_zip(path: Path, entries: list[tuple[str, bytes]], compress: set[str] = frozenset()):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of a duplicate name, and writes it
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
            for name, data in entries:
                method = zipfile.ZIP_DEFLATED if name in compress else zipfile.ZIP_STORED
                zout.writestr(name, data, compress_type=method)


def _entries(path: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as z:
        return [(n, z.read(n)) for n in z.namelist()]


@pytest.mark.parametrize(
    "change, words",
    [
        ("append", "bytes follow the end of the zip archive"),
        ("prepend", "the zip directory is not where its end record says"),
        ("dotdot", "member name '../evil.json' is not a plain relative path"),
        ("absolute", "member name '/evil.json' is not a plain relative path"),
        ("backslash", r"member name 'a\\\\evil.json' is not a plain relative path"),
        ("duplicate", r"members named twice: \['layouts.json'\]"),
        ("compressed", "member 'layouts.json' is compressed"),
        ("unlisted", r"not listed: \['notes.txt'\]"),
        ("missing", r"missing: \['layouts.json'\]"),
        ("comment", "bytes follow the end of the zip archive"),
    ],
)
def test_zip_layout_a_package_never_has_is_refused(built, tmp_path, change, words):
    _, _, _, single = built
    entries = _entries(single)
    bad = tmp_path / "bad.tessel"
    layouts = dict(entries)["layouts.json"]
    if change in ("append", "prepend"):
        data = single.read_bytes()
        bad.write_bytes(data + b"PK\x03\x04 trailing" if change == "append" else b"garbage" + data)
    elif change in ("dotdot", "absolute", "backslash"):
        name = {"dotdot": "../evil.json", "absolute": "/evil.json", "backslash": "a\\evil.json"}
        _raw_zip(bad, [*entries, (name[change], b"{}")])
    elif change == "duplicate":
        _raw_zip(bad, [*entries, ("layouts.json", layouts)])
    elif change == "compressed":
        _raw_zip(bad, entries, compress={"layouts.json"})
    elif change == "unlisted":
        _raw_zip(bad, [*entries, ("notes.txt", b"hello")])
    elif change == "missing":
        _raw_zip(bad, [e for e in entries if e[0] != "layouts.json"])
    elif change == "comment":
        with zipfile.ZipFile(bad, "w") as zout:
            for name, data in entries:
                zout.writestr(name, data)
            zout.comment = b"hello"
    with pytest.raises(PackageError, match=words):
        Package.open(bad)


def test_zip64_end_records_are_read(built, tmp_path, monkeypatch):
    """Packages past 4 GiB end in zip64 records; a small one made to end that way opens."""
    _, ids, _, single = built
    entries = _entries(single)
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 1000)  # any offset past 1000 bytes needs zip64
    with zipfile.ZipFile(tmp_path / "z64.tessel", "w") as zout:
        for name, data in entries:
            zout.writestr(name, data)
    monkeypatch.undo()
    assert (tmp_path / "z64.tessel").read_bytes()[-98:-94] == b"PK\x06\x06"
    Package.open(tmp_path / "z64.tessel").verify()
    appended = tmp_path / "z64_appended.tessel"
    appended.write_bytes((tmp_path / "z64.tessel").read_bytes() + b"x" * 40)
    with pytest.raises(PackageError, match="bytes follow the end"):
        Package.open(appended)


def test_format_version_1_packages_still_load(built, tmp_path):
    """Version 1 had no tied weights, and its early packages no strategy member and no outputs."""
    model, ids, _, single = built

    def downgrade(m: dict) -> None:
        m["format_version"] = 1
        for s in m["submodels"]:
            s.pop("tied")
        m.pop("strategy")
        m.pop("outputs")

    entries = [e for e in _entries(single) if e[0] != "strategy.json"]
    v1 = tmp_path / "v1.tessel"
    _raw_zip(tmp_path / "src.tessel", entries)
    _tamper(tmp_path / "src.tessel", v1, manifest=downgrade)
    manifest = Package.open(v1).manifest
    assert manifest.format_version == 1 and manifest.strategy is None and manifest.outputs is None
    (out,) = tessel.load_model(v1)(ids)
    with torch.no_grad():
        assert (out - model(ids)).abs().max().item() <= 1e-5


@pytest.fixture(scope="module")
def manifest_json(built):
    _, _, path, _ = built
    return json.loads(zipfile.ZipFile(path).read(MANIFEST))


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_edit_of_a_manifest_is_read_or_refused_as_a_package_error(manifest_json, data):
    """Replace any one value of a real manifest with any JSON: it reads, and `tessel inspect`
    shows it, or it is refused with a PackageError; never another exception."""
    from tessel.report import format_plan, inspect_json

    m = replaced(manifest_json, data)
    try:
        manifest = Manifest.from_json(m, "fuzz")
    except PackageError:
        return
    format_plan(manifest)
    json.dumps(inspect_json(manifest))


@pytest.fixture(scope="module")
def training_manifest_json(tmp_path_factory):
    """A training package's manifest: AdamW in two parameter groups over a 1-layer Llama."""
    from tests.conftest import hf_llama

    model = hf_llama(layers=1).train()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 1e-2}])
    ids = token_ids()
    built = tessel.build(model, {"input_ids": ids, "labels": ids}, cluster=2, optimizer=optimizer)
    path = tessel.save(built, tmp_path_factory.mktemp("training") / "step")
    return json.loads(zipfile.ZipFile(path).read(MANIFEST))


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_edit_of_a_training_manifest_is_read_or_refused_as_a_package_error(
    training_manifest_json, data
):
    """Its optimizer fields and parameter groups too: a value torch's constructor would refuse,
    or a group that names an unknown weight, one twice, or misses one, is a PackageError."""
    m = {**training_manifest_json, "training": replaced(training_manifest_json["training"], data)}
    try:
        manifest = Manifest.from_json(m, "fuzz")
    except PackageError:
        return
    from tessel.config.optimizer import make_optimizer, spec_from_json

    training = manifest.training
    spec = spec_from_json(training.optimizer, "fuzz", training.gradients)
    make_optimizer(spec, {n: [torch.zeros(2, requires_grad=True)] for n in training.gradients})


@pytest.mark.parametrize(
    "edit, key, words",
    [
        (
            lambda g: g[0].update(lr=-1.0),
            "param_groups[0].lr",
            "found -1.0; expected a number >= 0",
        ),
        (lambda g: g[0].update(lr=[0.1]), "param_groups[0].lr", "expected a number >= 0"),
        (lambda g: g[1].update(betas=[1.0, 0.9]), "param_groups[1].betas", "in [0, 1)"),
        (lambda g: g[0].update(eps=-1e-8), "param_groups[0].eps", "expected a number >= 0"),
        (lambda g: g[0].update(amsgrad=1), "param_groups[0].amsgrad", "expected true or false"),
        (lambda g: g[0]["params"].append("nowhere.weight"), "param_groups[0].params", "'nowhere"),
        (lambda g: g[1]["params"].append(g[0]["params"][0]), "param_groups[1].params", "second"),
        (lambda g: g[1]["params"].pop(), "param_groups", "leave 1 trained weights out"),
    ],
)
def test_a_training_manifests_optimizer_is_checked_as_torch_checks_it(
    training_manifest_json, edit, key, words
):
    m = json.loads(json.dumps(training_manifest_json))
    edit(m["training"]["optimizer"]["param_groups"])
    with pytest.raises(PackageError, match=rf"manifest training\.optimizer\.{re.escape(key)}: "):
        Manifest.from_json(m, "edited")
    with pytest.raises(PackageError, match=re.escape(words)):
        Manifest.from_json(m, "edited")


def test_a_training_package_records_the_models_state_dict_and_config(training_manifest_json):
    """What turns its checkpoints into the model's own files: every state_dict key of the
    Llama under its checkpoint name, and its config as a member."""
    from tests.conftest import hf_llama

    training = training_manifest_json["training"]
    keys = hf_llama(layers=1).state_dict()
    assert training["state_dict"] == {k: k for k in keys}
    assert training["model_config"] == "model/config.json"
    assert training["generation_config"] == "model/generation_config.json"


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("state_dict", ["w"], "training.state_dict: expected an object"),
        ("state_dict", {"w": 3}, "training.state_dict['w']: expected a string"),
        ("state_dict", {"w": ""}, "training.state_dict['w']: expected a checkpoint name"),
        ("state_dict", {"": "w"}, "training.state_dict['']: expected non-empty state_dict keys"),
        ("model_config", "model/nowhere.json", "training.model_config: names the member"),
        ("generation_config", 7, "training.generation_config: expected a string"),
        ("generation_config", "../x", "training.generation_config: '../x' is not a valid"),
    ],
)
def test_a_training_manifests_model_record_is_checked(training_manifest_json, key, value, words):
    m = json.loads(json.dumps(training_manifest_json))
    m["training"][key] = value
    with pytest.raises(PackageError, match=re.escape(f"edited: manifest {words}")):
        Manifest.from_json(m, "edited")


def test_the_mesh_is_recorded_once_and_earlier_packages_repeating_it_must_agree(
    training_manifest_json,
):
    """A training step reads its replicas, stages and tensor-parallel ranks from the mesh; a
    package of an earlier tessel also gives them in `training`, where they must agree."""
    m = json.loads(json.dumps(training_manifest_json))
    mesh = Manifest.from_json(m, "now").mesh
    assert not {"data_parallel", "tensor_parallel", "pipeline_stages"} & set(m["training"])
    sizes = {
        "data_parallel": mesh.size("dp"),
        "tensor_parallel": mesh.tensor_parallel,
        "pipeline_stages": mesh.size("pp"),
    }
    assert math.prod(sizes.values()) == m["world_size"]
    m["training"].update(sizes)
    assert (
        Manifest.from_json(m, "earlier").training
        == Manifest.from_json(training_manifest_json, "now").training
    )
    m["training"]["data_parallel"] = sizes["data_parallel"] + 1
    with pytest.raises(PackageError, match=r"training.data_parallel: is \d+, but the mesh"):
        Manifest.from_json(m, "edited")


def test_an_optimizer_group_edited_after_construction_is_refused_at_build():
    from tessel.config.errors import ConfigError
    from tessel.config.optimizer import optimizer_spec

    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    optimizer.param_groups[0]["lr"] = -0.1
    with pytest.raises(ConfigError, match=r"param_groups\[0\]\.lr: found -0.1"):
        optimizer_spec(optimizer, {id(weight): "w"}, ("w",))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_edit_of_a_program_is_loaded_or_refused_as_a_program_error(built, data):
    from tessel.lower.program import decode

    _, _, _, single = built
    package = Package.open(single)
    program = replaced(package.json(package.submodel(0).program), data)
    try:
        decode(program, {}, torch.device("cpu"), {})
    except ProgramError:
        pass


@pytest.fixture(scope="module")
def pipeline_package(tmp_path_factory):
    """A training package on two pipeline stages: GPT-2, whose tied embedding the last stage
    reads from the first."""
    folder = tmp_path_factory.mktemp("pipeline")
    policy = folder / "policy.json"
    option = {"auto": False, "pipeline_parallel_option": {"pipe_stage_num": 2}}
    policy.write_text(json.dumps({"graph_parallel_option": option}))
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    ids = token_ids()
    built = tessel.build(
        model,
        {"input_ids": ids, "labels": ids},
        cluster=2,
        policy=policy,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )
    return tessel.save(built, folder / "step")


@pytest.fixture(scope="module")
def pipeline_manifest_json(pipeline_package):
    return json.loads(zipfile.ZipFile(pipeline_package).read(MANIFEST))


def test_a_pipeline_stage_is_a_forward_and_a_backward_pass_with_handoffs(pipeline_manifest_json):
    first, last = (s["passes"] for s in pipeline_manifest_json["submodels"])
    assert first["handoffs"] == last["handoffs"]  # one pipeline: both ranks list it alike
    routes = [(tuple(h["sender"]), tuple(h["receiver"]), h["once"]) for h in first["handoffs"]]
    assert (("F", 0), ("F", 1), False) in routes  # activations on
    assert (("B", 1), ("B", 0), False) in routes  # gradients back
    assert (("F", 0), ("F", 1), True) in routes  # the tied embedding, once per step
    assert first["loss"] == last["loss"] == ["F", 1]
    assert first["saved"] > 0 and last["saved"] > 0
    programs = {s["program"] for s in pipeline_manifest_json["submodels"]}
    backward = {s["passes"]["backward"] for s in pipeline_manifest_json["submodels"]}
    assert len(programs | backward) == 4


def test_each_stage_computes_its_own_layers_backward_pass(pipeline_package):
    """Each stage's backward pass computes both products of every layer it holds (the input's
    gradient and the weight's) itself: the first stage's is not left to the last stage, which
    would need the first stage's weights for it. Only the tied embedding is handed over."""
    products = {"aten.mm.default", "aten.addmm.default"}
    with zipfile.ZipFile(pipeline_package) as z:
        manifest = json.loads(z.read(MANIFEST))
        for sub in manifest["submodels"]:
            forward, backward = (
                sum(n.get("target") in products for n in json.loads(z.read(member))["nodes"])
                for member in (sub["program"], sub["passes"]["backward"])
            )
            assert backward >= 2 * forward - 1 > 0, (sub["rank"], forward, backward)
    handoffs = manifest["submodels"][0]["passes"]["handoffs"]
    assert [h["shape"] for h in handoffs if h["once"]] == [[256, 32]]


def test_a_forward_pass_saves_no_view_for_its_backward_pass(pipeline_package):
    """What the backward pass can compute again for free (a view of its stage's weights or of
    what it holds) is not saved per micro-batch, where it would be counted once per micro-batch
    held. A view of a weight handed over from another stage is saved (the backward pass is not
    handed the weight)."""
    from tessel.plan.cost import is_view

    with zipfile.ZipFile(pipeline_package) as z:
        manifest = json.loads(z.read(MANIFEST))
        for rank, sub in enumerate(manifest["submodels"]):
            passes = sub["passes"]
            nodes = json.loads(z.read(sub["program"]))["nodes"]
            inputs = [n["name"] for n in nodes if n["op"] == "input"]
            handed = set(inputs[len(sub["weight_order"]) + len(manifest["inputs"]) :])
            made = {n["name"]: n for n in nodes if n["op"] == "call"}
            returned = [a["$node"] for a in nodes[-1]["args"]]
            sent = sum(1 for h in passes["handoffs"] if h["sender"] == ["F", rank])
            saved = returned[sent : sent + passes["saved"]]
            assert saved, rank
            views = [
                a for a in saved
                if a in made and made[a]["target"] != "getitem" and is_view(made[a]["target"])
                and not handed & {x["$node"] for x in made[a]["args"] if isinstance(x, dict)}
            ]  # fmt: skip
            assert not views, (rank, views)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_edit_of_a_pipeline_stages_passes_is_read_or_refused_as_a_package_error(
    pipeline_manifest_json, data
):
    m = json.loads(json.dumps(pipeline_manifest_json))
    m["submodels"][1]["passes"] = replaced(m["submodels"][1]["passes"], data)
    try:
        manifest = Manifest.from_json(m, "fuzz")
    except PackageError:
        return
    passes = manifest.submodels[1].passes
    assert all(h.sender[1] < 2 and h.receiver[1] < 2 for h in passes.handoffs)


@pytest.mark.parametrize(
    "edit, words",
    [
        (
            lambda m: m["submodels"][1].pop("passes"),
            r"manifest submodels\[1\]: has no forward and backward passes for its pipeline stage: "
            "the package was built by an earlier tessel",
        ),
        (
            lambda m: m["submodels"][0]["passes"]["handoffs"][0].update(receiver=["F", 2]),
            r"manifest submodels\[0\]\.passes\.handoffs\[0\]\.receiver: names stage 2; the mesh "
            "has 2 pipeline stages",
        ),
        (
            lambda m: m["submodels"][0]["passes"].update(loss=["X", 1]),
            r"manifest submodels\[0\]\.passes\.loss\[0\]: .*'X'",
        ),
    ],
    ids=["no_passes", "stage_past_the_mesh", "no_phase"],
)
def test_a_pipeline_stages_passes_are_checked(pipeline_manifest_json, edit, words):
    m = json.loads(json.dumps(pipeline_manifest_json))
    edit(m)
    with pytest.raises(PackageError, match=words):
        Manifest.from_json(m, "edited")
