"""Pre-sliced models: slices written by hand (a two-rank MLP whose forward calls
`funcol.all_reduce`), a hand-written model_relation_config.json, built with `tessel build
--shard_model_dir` and run by a Session against the whole MLP; and every rule of the relation
config and the slices, each with its own message."""

from __future__ import annotations

import gc
import json
import logging
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import tessel
from tessel._torch import fake_process_group
from tessel.builder.slices import build_from_slices
from tessel.cli import main
from tessel.config.cluster import local_cluster, local_cluster_dict
from tessel.config.errors import ConfigError

IN, HIDDEN, OUT, ROWS = 8, 16, 6, 4


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(HIDDEN, IN, generator=g),
        "b1": torch.randn(HIDDEN, generator=g),
        "w2": torch.randn(OUT, HIDDEN, generator=g),
    }


def _eager(x: torch.Tensor) -> torch.Tensor:
    w = _weights()
    return torch.relu(x @ w["w1"].T + w["b1"]) @ w["w2"].T


class MlpSlice(torch.nn.Module):
    """Rank `rank` of `world`: a column slice of the first layer, a row slice of the second,
    their partial sums added over `group` (Megatron's MLP, written by hand)."""

    def __init__(
        self, rank: int, world: int, extra_reduce: bool = False, op=None, reduce_op: str = "sum"
    ) -> None:
        super().__init__()
        w, part = _weights(), HIDDEN // world
        rows = slice(rank * part, (rank + 1) * part)
        self.up = torch.nn.Linear(IN, part)
        self.down = torch.nn.Linear(part, OUT, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(w["w1"][rows])
            self.up.bias.copy_(w["b1"][rows])
            self.down.weight.copy_(w["w2"][:, rows])
        self.extra_reduce = extra_reduce
        self.op = op
        self.reduce_op = reduce_op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if self.op is not None:
            h = h + self.op(h)
        y = funcol.all_reduce(self.down(h), self.reduce_op, dist.group.WORLD)
        if self.extra_reduce:
            y = funcol.all_reduce(y, "sum", dist.group.WORLD)
        return y


def _export(folder: Path, world: int = 2, rows: int = ROWS, **per_rank) -> list[str]:
    """Write one slice per rank (`per_rank` maps a rank to MlpSlice keyword arguments)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for rank in range(world):
        with fake_process_group(rank, world):
            module = MlpSlice(rank, world, **per_rank.get(f"rank{rank}", {}))
            example = torch.randn(rows if rank == 0 else per_rank.get("rows1", rows), IN)
            ep = torch.export.export(module, (example,))
        name = f"mlp_rank{rank}.pt2"
        torch.export.save(ep, folder / name)
        names.append(name)
    return names


def _relation(names: list[str], groups=None, devices=None, ranks=None) -> dict:
    devices = devices or [f"0:0:{i}" for i in range(len(names))]
    ranks = ranks if ranks is not None else list(range(len(names)))
    return {
        "deploy_config": [
            {"submodel_name": n, "deploy_device_id_list": d} for n, d in zip(names, devices)
        ],
        "model_name_to_instance_id": [
            {"submodel_name": n, "model_instance_id": i} for i, n in enumerate(names)
        ],
        "comm_group": groups
        if groups is not None
        else [{"group_name": "0", "group_rank_list": str(list(range(len(names))))}],
        "rank_table": [{"rank_id": r, "model_instance_id": i} for i, r in enumerate(ranks)],
    }


def _write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data, indent=1))
    return path


@pytest.fixture(scope="module")
def two_slices(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("slices") / "mlp"
    names = _export(folder)
    _write(folder / "model_relation_config.json", _relation(names))
    return folder


def test_hand_written_slices_build_and_run_equal_to_the_whole_model(two_slices, tmp_path, capsys):
    cluster = _write(tmp_path / "numa_config_2p.json", local_cluster_dict(2))
    args = [
        "build",
        "--distributed_cluster_build=1",
        f"--cluster_config={cluster}",
        f"--shard_model_dir={two_slices}",
        f"--model_relation_config={two_slices / 'model_relation_config.json'}",
        "--framework=pytorch",
        "--soc_version=cpu",
        f"--output={tmp_path / 'out' / 'mlp'}",
    ]
    assert main(args) == 0, capsys.readouterr().err
    path = tmp_path / "out" / "mlp.tessel"
    x = torch.randn(ROWS, IN, generator=torch.Generator().manual_seed(3))
    tessel.initialize()
    try:
        session = tessel.Session()
        session.load_graph(0, {}, path)
        (y,) = session.run_graph(0, [x])
        (y2,) = session.run_graph(0, [2 * x])
    finally:
        tessel.finalize()
    torch.testing.assert_close(y, _eager(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y2, _eager(2 * x), rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "built from pre-sliced models" in text and "rank 1 mlp_rank1.pt2" in text
    assert "all_reduce" in text


def test_each_rank_holds_its_own_slice_and_the_groups_are_the_relation_configs(two_slices):
    built = build_from_slices(
        two_slices, two_slices / "model_relation_config.json", local_cluster(2)
    )
    subs = built.manifest.submodels
    assert [s.comm_groups for s in subs] == [((0, 1),), ((0, 1),)]
    held = [built.members[s.weights[0]] for s in subs]
    w = _weights()
    torch.testing.assert_close(held[1]["up.weight"], w["w1"][HIDDEN // 2 :])
    torch.testing.assert_close(held[0]["down.weight"], w["w2"][:, : HIDDEN // 2])
    assert built.manifest.inputs[0].shape == (ROWS, IN)
    assert built.manifest.outputs[0].shape == (ROWS, OUT)


def test_a_group_whose_ranks_would_change_order_on_the_devices_is_refused(two_slices, tmp_path):
    # rank 0 on device 0:0:1 and rank 1 on 0:0:0: a collective would put the parts together
    # in the devices' order, not the ranks'
    relation = _relation(
        ["mlp_rank1.pt2", "mlp_rank0.pt2"], devices=["0:0:0", "0:0:1"], ranks=[1, 0]
    )
    message = _refused(two_slices, relation, tmp_path)
    assert "comm_group: group '0' holds ranks [0, 1], deployed on the cluster's ranks [1, 0]" in (
        message
    )


def _refused(folder: Path, relation: dict | Path, tmp_path: Path, cluster=None) -> str:
    path = relation if isinstance(relation, Path) else _write(tmp_path / "rel.json", relation)
    with pytest.raises(ConfigError) as info:
        build_from_slices(folder, path, cluster or local_cluster(2))
    return str(info.value)


NAMES = ["mlp_rank0.pt2", "mlp_rank1.pt2"]


@pytest.mark.parametrize(
    "change, words",
    [
        (
            lambda r: [
                r[key][1].update(submodel_name="missing.pt2")
                for key in ("deploy_config", "model_name_to_instance_id")
            ],
            "deploy_config[1].submodel_name: 'missing.pt2' is not in the slice directory",
        ),
        (
            lambda r: r["deploy_config"][1].update(deploy_device_id_list="0:0:0"),
            "deploy_config[1].deploy_device_id_list: device '0:0:0' appears twice",
        ),
        (
            lambda r: r["deploy_config"][1].update(deploy_device_id_list="0:0:7"),
            "deploy_config[1].deploy_device_id_list: device '0:0:7' is not in the cluster config",
        ),
        (
            lambda r: r["deploy_config"][1].update(deploy_device_id_list="0:0"),
            "deploy_config[1].deploy_device_id_list: found string '0:0'; expected a value like",
        ),
        (
            lambda r: r["model_name_to_instance_id"][1].update(model_instance_id=0),
            "model_name_to_instance_id[1].model_instance_id: model_instance_id 0 appears twice",
        ),
        (
            lambda r: r["rank_table"][1].update(model_instance_id=5),
            "rank_table[1].model_instance_id: names instance 5, which model_name_to_instance_id "
            "does not give",
        ),
        (
            lambda r: r["rank_table"].pop(),
            "rank_table: gives no rank_id to the slices ['mlp_rank1.pt2']",
        ),
        (
            lambda r: r["comm_group"][0].update(group_rank_list="[0,2]"),
            "comm_group[0].group_rank_list: names ranks [2]; the slices' ranks are 0..1",
        ),
        (
            lambda r: r["comm_group"][0].update(group_rank_list="0,1]"),
            "comm_group[0].group_rank_list: found string '0,1]'; expected a list of ranks",
        ),
        (
            lambda r: r["comm_group"][0].update(group_name="tp"),
            "a collective names group '0', which",
        ),
        (
            lambda r: r["comm_group"][0].update(group_rank_list="[0]"),
            "is rank 1, but its collective's group '0' holds ranks [0]",
        ),
        (lambda r: r.update(ranks=[]), "unknown key; allowed keys here"),
        (
            lambda r: r["comm_group"][0].update(group_rank_list="[1,0]"),
            "comm_group[0].group_rank_list: lists ranks [1, 0] out of order",
        ),
        (
            lambda r: r["deploy_config"][1].update(submodel_name="../mlp_rank1.pt2"),
            "deploy_config[1].submodel_name: found '../mlp_rank1.pt2'; expected the name of a "
            "file in the slice directory",
        ),
        (
            lambda r: r["deploy_config"][1].update(submodel_name="/tmp/mlp_rank1.pt2"),
            "deploy_config[1].submodel_name: found '/tmp/mlp_rank1.pt2'",
        ),
    ],
)
def test_relation_rules_each_name_the_entry(two_slices, tmp_path, change, words):
    relation = _relation(NAMES)
    change(relation)
    message = _refused(two_slices, relation, tmp_path)
    assert words in message, message
    assert "rel.json" in message or ".pt2" in message


def test_a_cluster_with_a_device_no_slice_runs_on_is_refused(two_slices, tmp_path):
    message = _refused(two_slices, _relation(NAMES), tmp_path, local_cluster(3))
    assert "deploys 2 slices on a cluster of 3 devices" in message and "0:0:2" in message


def test_slices_whose_collectives_differ_are_refused_before_they_could_hang(tmp_path):
    folder = tmp_path / "s"
    names = _export(folder, rank1={"extra_reduce": True})
    message = _refused(folder, _relation(names), tmp_path)
    assert "mlp_rank1.pt2" in message
    assert "collective 1 in group '0' is all_reduce (sum) of float32[4, 6]" in message
    assert "issues nothing (its collectives end earlier)" in message


def test_slices_whose_reductions_differ_are_refused(tmp_path):
    folder = tmp_path / "s"
    names = _export(folder, rank1={"reduce_op": "max"})
    message = _refused(folder, _relation(names), tmp_path)
    assert (
        "collective 0 in group '0' is all_reduce (max) of float32[4, 6], but mlp_rank0.pt2 "
        "(rank 0) issues all_reduce (sum) of float32[4, 6]"
    ) in message


def test_slices_that_take_different_inputs_are_refused(tmp_path):
    folder = tmp_path / "s"
    names = _export(folder, rows1=2)
    message = _refused(folder, _relation(names), tmp_path)
    assert "mlp_rank1.pt2" in message and "takes inputs [float32[2, 8]]" in message


def test_an_operator_off_the_list_is_refused_by_name(tmp_path):
    folder = tmp_path / "s"
    median = lambda h: torch.median(h)  # noqa: E731
    names = _export(folder, rank0={"op": median}, rank1={"op": median})
    message = _refused(folder, _relation(names), tmp_path)
    assert "mlp_rank0.pt2" in message and "median" in message


def test_an_unnamed_slice_is_ignored_with_a_warning(two_slices, tmp_path, caplog):
    folder = tmp_path / "s"
    folder.mkdir()
    for name in [*NAMES, "model_relation_config.json"]:
        (folder / name).write_bytes((two_slices / name).read_bytes())
    (folder / "old_rank7.pt2").write_bytes((two_slices / NAMES[0]).read_bytes())
    with caplog.at_level(logging.WARNING):
        build_from_slices(folder, folder / "model_relation_config.json", local_cluster(2))
    assert "old_rank7.pt2 is not named in" in caplog.text


def test_a_file_that_is_no_export_archive_is_refused(two_slices, tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    (folder / NAMES[0]).write_bytes((two_slices / NAMES[0]).read_bytes())
    (folder / NAMES[1]).write_bytes(b"not a zip")
    message = _refused(folder, _relation(NAMES), tmp_path)
    assert "mlp_rank1.pt2: does not load as a torch.export.save archive" in message


def test_a_pickled_weight_is_refused_unread(two_slices, tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    (folder / NAMES[0]).write_bytes((two_slices / NAMES[0]).read_bytes())
    with (
        zipfile.ZipFile(two_slices / NAMES[1]) as src,
        zipfile.ZipFile(folder / NAMES[1], "w") as dst,
    ):
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("model_weights_config.json"):
                config = json.loads(data)
                first = next(iter(config["config"]))
                config["config"][first]["use_pickle"] = True
                data = json.dumps(config).encode()
            dst.writestr(info, data)
    message = _refused(folder, _relation(NAMES), tmp_path)
    assert "mlp_rank1.pt2: weight" in message and "is stored as a pickle" in message


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--model_relation_config=r.json"], "--model_relation_config: is used only with"),
        (["--shard_model_dir=d"], "--shard_model_dir: needs --model_relation_config"),
        (
            ["--shard_model_dir=d", "--model_relation_config=r.json"],
            "--shard_model_dir: needs --distributed_cluster_build=1",
        ),
        (
            [
                "--shard_model_dir=d",
                "--model_relation_config=r.json",
                "--distributed_cluster_build=1",
            ],
            "--cluster_config: is required with --shard_model_dir",
        ),
        (
            [
                "--shard_model_dir=d",
                "--model_relation_config=r.json",
                "--distributed_cluster_build=1",
                "--enable_graph_parallel=1",
            ],
            "--enable_graph_parallel: partitions a complete model",
        ),
    ],
)
def test_slice_flags_go_together(tmp_path, capsys, flags, words):
    assert main(["build", *flags, f"--output={tmp_path / 'o'}"]) == 2
    assert words in capsys.readouterr().err


def _megatron_plan(model: torch.nn.Module, mesh) -> None:
    """torch's own tensor parallelism on a test model: Llama's projections with
    parallelize_module; GPT-2's Conv1D MLP with distribute_module (parallelize_module takes
    only Linear and Embedding)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor import distribute_tensor as dist_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    lm = model.lm
    if hasattr(lm, "model"):  # Llama
        plan = {}
        for i in range(len(lm.model.layers)):
            p = f"lm.model.layers.{i}."
            plan.update({p + f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"})
            plan.update({p + f"mlp.{n}_proj": ColwiseParallel() for n in ("gate", "up")})
            plan.update({p + "self_attn.o_proj": RowwiseParallel()})
            plan.update({p + "mlp.down_proj": RowwiseParallel()})
        parallelize_module(model, mesh, plan)
        return

    def sharded(dims: dict[str, int]):
        def partition(name, module, mesh):
            for pname, p in list(module.named_parameters(recurse=False)):
                placement = [Shard(dims[pname])] if pname in dims else [Replicate()]
                module.register_parameter(
                    pname, torch.nn.Parameter(dist_tensor(p.data, mesh, placement))
                )

        return partition

    def to_dtensor(module, inputs, mesh):
        return tuple(
            x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()])
            for x in inputs
        )

    def to_whole(module, out, mesh):
        return out.redistribute(mesh, [Replicate()]).to_local()

    for block in lm.transformer.h:
        distribute_module(block.mlp.c_fc, mesh, sharded({"weight": 1, "bias": 0}), to_dtensor)
        distribute_module(block.mlp.c_proj, mesh, sharded({"weight": 0}), to_dtensor, to_whole)


def _export_rank(rank: int, world: int, port: int, family: str, folder: str) -> None:
    from tests.conftest import small_gpt2, small_llama, token_ids
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        model = small_llama() if family == "llama" else small_gpt2()
        _megatron_plan(model, init_device_mesh("cpu", (world,)))
        tessel.export_slice(model, (token_ids(),), folder, prefix="tp_rank")
    finally:
        # the model's DTensors hold the mesh and its process group: let them go while the
        # interpreter is whole, so the group's threads are joined by destroy_process_group and
        # not torn down at exit (gloo aborts the process there)
        model = None
        gc.collect()
        dist.destroy_process_group()


# each family at one count and each count by one family (the slice script of docs/guides/pre-sliced-and-onnx.md runs a
# 4-rank torchrun job of its own)
@pytest.mark.parametrize("family, world", [("llama", 4), ("gpt2", 2)])
def test_a_model_parallelised_by_torch_exports_builds_and_runs_equal_to_eager(
    tmp_path, family, world
):
    import socket

    from tests.conftest import small_gpt2, small_llama, start_ranks, token_ids

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tmp_path / "slices"
    start_ranks(_export_rank, (world, port, family, str(folder)), world)
    relation = json.loads((folder / "model_relation_config.json").read_text())
    assert [d["deploy_device_id_list"] for d in relation["deploy_config"]] == [
        f"0:0:{r}" for r in range(world)
    ]
    assert relation["comm_group"] == [
        {"group_name": "0", "group_rank_list": str(list(range(world)))}
    ]
    built = build_from_slices(folder, folder / "model_relation_config.json", local_cluster(world))
    path = built.save(tmp_path / "tp")
    model = small_llama() if family == "llama" else small_gpt2()
    ids = token_ids(seed=5)
    with torch.no_grad():
        expected = model(ids)
    tessel.initialize()
    try:
        session = tessel.Session()
        session.load_graph(0, {}, path)
        (out,) = session.run_graph(0, [ids])
    finally:
        tessel.finalize()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    # each rank holds its shard only: rank 1's first sharded projection is a slice
    # weights every rank holds whole (embeddings, norms) are stored once, shared by the ranks
    shared = built.members["weights/replicated.safetensors"]
    embedding = "lm.model.embed_tokens.weight" if family == "llama" else "lm.transformer.wte.weight"
    assert embedding in shared
    assert all(s.weights[0] == "weights/replicated.safetensors" for s in built.manifest.submodels)
    held = built.members[built.manifest.submodels[1].weights[-1]]
    assert embedding not in held
    full = dict(model.named_parameters())
    name = (
        "lm.model.layers.0.mlp.up_proj.weight"
        if family == "llama"
        else ("lm.transformer.h.0.mlp.c_fc.weight")
    )
    assert held[name].numel() * world == full[name].numel()
