"""The offline model file: refused when truncated, altered, of an unknown version, or loaded wrongly."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch
from tests.conftest import small_gpt2, small_llama, token_ids

import tessel
from tessel.package import Package, PackageError
from tessel.package.format import MANIFEST


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


def test_manifest_records_what_a_loader_needs(built):
    _, _, path, _ = built
    m = Package.open(path).manifest
    assert m["format_version"] == 2 and m["torch_version"] == torch.__version__
    assert m["mesh"]["shape"] == [2] and len(m["submodels"]) == 2
    for s in m["submodels"]:
        assert {"rank", "logical_device", "program", "weights", "comm_groups"} <= set(s)
    layouts = Package.open(path).json(m["layouts"])
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


def test_program_naming_foreign_code_is_refused(built, tmp_path):
    _, _, path, single = built
    evil = tmp_path / "evil.tessel"
    m = json.loads(zipfile.ZipFile(single).read(MANIFEST))
    program_name = m["submodels"][0]["program"]

    def inject(name, data):
        if name == program_name:
            p = json.loads(data)
            p["nodes"].insert(
                1,
                {
                    "op": "call",
                    "name": "x",
                    "target": "builtins.eval.default",
                    "args": ["1"],
                    "kwargs": {},
                },
            )
            return json.dumps(p).encode()
        if name == MANIFEST:
            return data
        return data

    _rewrite(single, evil, inject)
    # the checksum catches the edit first; with the checksum updated, the op allow-list refuses it
    with pytest.raises(PackageError, match="fails its checksum"):
        tessel.load_model(evil)
    import hashlib

    fixed = tmp_path / "evil2.tessel"

    def fix(name, data):
        if name == MANIFEST:
            mm = json.loads(data)
            program = zipfile.ZipFile(evil).read(program_name)
            mm["files"][program_name] = hashlib.sha256(program).hexdigest()
            return json.dumps(mm).encode()
        return data

    _rewrite(evil, fixed, fix)
    from tessel.lower.program import ProgramError

    with pytest.raises(ProgramError, match="unknown operator 'builtins.eval.default'"):
        tessel.load_model(fixed)


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
    with pytest.raises(OSError):
        fmt.write_package(target, {"format": "x"}, {"a": b"1"})
    assert target.read_bytes() == b"earlier output"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.tessel"]


def test_package_carries_a_strategy_file_for_checkpoint_tools(built, tmp_path):
    from tessel.parallel import load_strategy

    _, _, path, _ = built
    package = Package.open(path)
    target = tmp_path / "strategy.json"
    target.write_bytes(package.read(package.manifest["strategy"]))
    strategy = load_strategy(target)
    layouts = package.json(package.manifest["layouts"])
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
        for sub in package.manifest["submodels"]:
            targets = [n.get("target") for n in package.json(sub["program"])["nodes"]]
            assert "aten.scaled_dot_product_attention.default" in targets
            assert not [t for t in targets if t and t.endswith("_for_cpu.default")]


def test_cpu_only_kernel_is_refused_on_another_device():
    from tessel.lower.program import ProgramError, decode

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
    assert decode(program, {}, torch.device("cpu"), {}) is not None
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

    from tessel.package.safetensors_io import tensors_from_buffer, write_safetensors

    tensors = _mixed_tensors()
    out = io.BytesIO()
    write_safetensors(out, tensors)
    ours = bytearray(out.getvalue())
    for read in (
        load(bytes(ours)),
        tensors_from_buffer(ours),
        tensors_from_buffer(bytearray(save(tensors))),
    ):
        assert read.keys() == tensors.keys()
        for k, t in tensors.items():
            assert read[k].dtype == t.dtype and torch.equal(read[k], t), k


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

    from tessel.lower.weights import local_shard

    model = small_gpt2(layers=1)  # lm_head.weight is wte.weight
    path = tessel.save(tessel.build(model, (token_ids(),), cluster=2), tmp_path / "gpt2")
    pkg = Package.open(path)
    members = [n for n in zipfile.ZipFile(path).namelist() if n.startswith("weights/")]
    stored = [k for m in members for k in pkg.tensors(m)]
    assert len(stored) == len(set(stored))
    layouts = pkg.json(pkg.manifest["layouts"])
    wte = model.lm.transformer.wte.weight.detach()
    ties = [s["tied"] for s in pkg.manifest["submodels"]]
    assert all(len(t) == 1 for t in ties), ties
    for rank, sub in enumerate(pkg.manifest["submodels"]):
        (name,) = sub["tied"]
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
    manifest = {k: v for k, v in pkg.manifest.items() if k != "files"}
    again = package_format.write_package(tmp_path / "again", manifest, members)
    assert len(syncs) > 5 and syncs[-1] == again.stat().st_size
    Package.open(again).verify()
    with zipfile.ZipFile(path) as before, zipfile.ZipFile(again) as after:
        assert after.namelist() == before.namelist()
        assert all(after.read(n) == before.read(n) for n in names)
