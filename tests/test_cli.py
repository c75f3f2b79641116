"""`tessel build | inspect | run` as a user types them, and the ATC flag rules' messages."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.conftest import (
    ctrl_c_as_in_a_terminal,
    is_multiprocessing_helper,
    signal_state,
    subprocess_env,
)

import tessel
from tessel.cli import main

ROOT = Path(__file__).resolve().parents[1]
TESSEL = [sys.executable, "-m", "tessel.cli"]
MODEL_PY = """
import sys
sys.path.insert(0, {root!r})
from tests.conftest import small_llama, token_ids

def build():
    return small_llama(), (token_ids(),)
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "model.py").write_text(MODEL_PY.format(root=str(ROOT)))
    cluster = json.loads((ROOT / "examples" / "cluster_4p.json").read_text())
    cluster["cluster"][0]["cluster_nodes"][0]["item_list"] = [{"item_id": 0}, {"item_id": 1}]
    # the small Llama replicated holds about 750 KB at its peak and the leanest plan about
    # 390 KB: devices of 576 KB make the plan shard weights, so the programs hold collectives
    cluster["item_def"][0]["memory"] = "[DDR:576KB]"
    (d / "cluster_2p.json").write_text(json.dumps(cluster))
    option = {
        "graph_parallel_option": {
            "auto": True,
            "tensor_parallel_option": {"tensor_parallel_size": 2},
        }
    }
    (d / "parallel_option.json").write_text(json.dumps(option))
    return d


@pytest.fixture(scope="module")
def model(files, tmp_path_factory) -> Path:
    """The small Llama built once by `tessel build` in a subprocess, for the tests that run it."""
    out = tmp_path_factory.mktemp("model") / "llama"
    built = subprocess.run(
        TESSEL + _build_args(files, **{"--output": str(out), "--log": "info"}),
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    path = out.with_name("llama.tessel")
    assert path.is_file()
    return path


def _build_args(d: Path, **extra: str) -> list[str]:
    args = {
        "--model": f"{d}/model.py:build",
        "--framework": "pytorch",
        "--soc_version": "cpu",
        "--output": f"{d}/out/llama",
        "--cluster_config": f"{d}/cluster_2p.json",
        "--distributed_cluster_build": "1",
        "--enable_graph_parallel": "1",
        "--graph_parallel_option_path": f"{d}/parallel_option.json",
        **extra,
    }
    return ["build"] + [f"{k}={v}" for k, v in args.items() if v is not None]


@pytest.mark.parametrize(
    "change, words",
    [
        (
            {"--framework": "3"},
            "--framework: found '3' (TensorFlow, which tessel does not take); accepted: pytorch, "
            "5 or onnx (ONNX)",
        ),
        (
            {"--distributed_cluster_build": "0"},
            "--enable_graph_parallel: =1 needs --distributed_cluster_build=1",
        ),
        ({"--cluster_config": None}, "--enable_graph_parallel: =1 needs --cluster_config"),
        ({"--graph_parallel_option_path": None}, "--graph_parallel_option_path: is mandatory"),
        ({"--enable_graph_parallel": "2"}, "--enable_graph_parallel: expected 0 or 1, found '2'"),
        ({"--log": "loud"}, "--log: found 'loud'; allowed: debug|info|warning|error|null"),
        ({"--shard_model_dir": "parts"}, "--shard_model_dir: needs --model_relation_config"),
        (
            {"--model": "nothing.onnx"},
            "--model: nothing.onnx is an ONNX file: build it with --framework=5",
        ),
        ({"--model": "nothing.txt"}, "--model: expected a .pt2 file or file.py:function"),
    ],
)
def test_flag_rules(files, capsys, change, words):
    assert main(_build_args(files, **change)) == 2
    err = capsys.readouterr().err
    assert words in err, err
    assert not (files / "out").exists()  # a refused build writes nothing


def test_policy_size_must_match_cluster(files, capsys, tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(
        '{"graph_parallel_option": {"tensor_parallel_option": {"tensor_parallel_size": 4}}}'
    )
    assert main(_build_args(files, **{"--graph_parallel_option_path": str(bad)})) == 2
    assert (
        "tensor_parallel_size: is 4 but the cluster config has 2 devices" in capsys.readouterr().err
    )


def test_trace_every_layer_reaches_capture_and_lowering(files, monkeypatch):
    import tessel.builder.pipeline as pipeline
    import tessel.lower.ranks as ranks

    seen: dict = {}
    real_capture, real_lower = pipeline.capture, ranks.lower_rank

    def capture(*args, **kwargs):
        seen["capture"] = kwargs.get("reuse_layers")
        return real_capture(*args, **kwargs)

    def lower_rank(*args, **kwargs):
        seen.setdefault("lower", set()).add(kwargs.get("stitch"))
        return real_lower(*args, **kwargs)

    monkeypatch.setattr(pipeline, "capture", capture)
    monkeypatch.setattr(ranks, "lower_rank", lower_rank)
    assert main(_build_args(files) + ["--trace_every_layer"]) == 0
    assert seen == {"capture": False, "lower": {False}}


def test_build_inspect_run(files, model):
    env = subprocess_env()
    shown = subprocess.run(
        TESSEL + ["inspect", str(model)], check=True, env=env, capture_output=True, text=True
    ).stdout
    assert "placements per layer" in shown and "rank 1 (0:0:1)" in shown
    data = json.loads(
        subprocess.run(
            TESSEL + ["inspect", "--json", str(model)], check=True, env=env, capture_output=True
        ).stdout
    )
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for r in data["ranks"]:
        assert {"rank", "logical_device", "weight_bytes", "collectives"} <= set(r)
        assert r["collectives"], r  # sharded weights: partial sums are reduced, shards gathered
        for c in r["collectives"]:
            assert isinstance(c["kind"], str) and c["group"] == [0, 1] and c["bytes"] > 0

    sys.path.insert(0, str(ROOT))
    from tests.conftest import small_llama, token_ids

    ids = token_ids(seed=3)
    save_file({"input_0": ids}, str(files / "x.safetensors"))
    subprocess.run(
        TESSEL
        + [
            "run",
            str(model),
            "--inputs",
            str(files / "x.safetensors"),
            "--output",
            str(files / "y.safetensors"),
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    out = load_file(str(files / "y.safetensors"))["output_0"]
    with torch.no_grad():
        reference = small_llama()(ids)
    assert (out - reference).abs().max().item() <= 1e-4
    # without --inputs: random inputs of the recorded shapes
    shown = subprocess.run(
        TESSEL + ["run", str(model)], check=True, env=env, capture_output=True, text=True
    ).stdout
    assert "output_0: [2, 16, 256] float32" in shown


def test_ctrl_c_leaves_no_worker(model, tmp_path):
    # standard error goes to a file: a pipe nobody reads while the runs go on could fill and
    # block the process
    errors = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen(
        TESSEL + ["run", str(model), "--repeat", "100000"],
        env=subprocess_env(PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
        preexec_fn=ctrl_c_as_in_a_terminal,
    )
    try:
        # "loaded on N devices" is printed once every worker has the model and runs begin
        for line in proc.stdout:
            if line.startswith("loaded on"):
                break
        else:
            proc.wait(timeout=60)
            errors.seek(0)
            raise AssertionError(f"exited ({proc.returncode}) before running:\n{errors.read()}")
        workers = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if not is_multiprocessing_helper(p)
        ]
        assert len(workers) >= 2, "no worker per device"
        state = signal_state(proc.pid)  # SIGINT is bit 2 (0x2): neither blocked nor ignored
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit 60 s after Ctrl-C; its signal state: {state}") from None
        errors.seek(0)
        err = errors.read()
        assert proc.returncode == 130 and "tessel: interrupted" in err, err
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, f"workers outlived Ctrl-C: {[p.pid for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        errors.close()


@pytest.fixture(scope="module")
def gpt2_package(tmp_path_factory):
    from tests.conftest import small_gpt2, token_ids

    path = tmp_path_factory.mktemp("gpt2") / "gpt2"
    return tessel.save(tessel.build(small_gpt2(layers=2), (token_ids(),), cluster=2), path)


def test_inspect_reads_the_manifest_without_importing_torch(gpt2_package, tmp_path):
    page = tmp_path / "plan.html"
    code = (
        "import json, sys\n"
        "from tessel.cli import main\n"
        f"assert main(['inspect', '--json', {str(gpt2_package)!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        f"assert main(['inspect', {str(gpt2_package)!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        f"assert main(['inspect', {str(gpt2_package)!r}, '--html', {str(page)!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr


def test_inspect_names_every_weight_unambiguously(gpt2_package, capsys):
    assert main(["inspect", str(gpt2_package)]) == 0
    text = capsys.readouterr().out
    assert "attn.c_proj.weight" in text and "mlp.c_proj.weight" in text
    section = text.split("placements per layer")[1].split("per device")[0]
    groups = section.strip().split("\n  ")  # one group per layer, or per run of equal layers
    for group in groups:
        names = [line.split()[0] for line in group.splitlines()[1:] if line.strip()]
        assert len(names) == len(set(names)), group
    assert main(["inspect", "--json", str(gpt2_package)]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    names = [name for params in layers.values() for name in params]
    assert len(names) == len(set(names))
    assert "lm.transformer.h.0.attn.c_proj.weight" in names
    assert "lm.transformer.h.0.mlp.c_proj.weight" in names


def test_inspect_shows_predicted_memory_the_check_against_eager_and_replans(gpt2_package, capsys):
    from tessel.package import Package, PackageError
    from tessel.package.manifest import Manifest
    from tessel.report import format_plan, inspect_json
    from tessel.units import human_bytes

    assert main(["inspect", str(gpt2_package)]) == 0
    text = capsys.readouterr().out
    manifest = Package.open(gpt2_package).manifest
    plan = manifest.plan
    memory = plan.memory
    for r in plan.ranks:  # the device's memory: 16 GiB, the cpu soc's default
        estimate = human_bytes(memory.rank_peak_bytes[r.rank])
        assert (
            f"rank {r.rank} ({r.logical_device}): weights {human_bytes(r.weight_bytes)}, "
            f"peak {human_bytes(r.peak_bytes)} of 16.00 GiB (planner's estimate {estimate}), "
            in text
        )
        assert r.weight_bytes <= r.peak_bytes
    assert (
        f"planner's estimate per device: weights {human_bytes(memory.weight_bytes)}, "
        f"peak {human_bytes(memory.peak_bytes)}, device memory 16.00 GiB" in text
    )
    # the other ranks' peak is shown where it differs from rank 0's (not here: a small model's
    # peak is in its layers, before the outputs)
    assert memory.other_ranks_peak_bytes == memory.peak_bytes
    assert "other ranks' peak" not in text
    assert "checked against eager: max relative difference " in text
    assert "re-planned" not in text
    # the run as the planner priced it, and as its lowered programs price it: one model of
    # one run, apart only by what the lowering adds (the outputs' gather to rank 0)
    planned, lowered = plan.estimated_time_s, plan.lowered_time_s
    assert 0.8 < lowered / planned < 1.25
    assert (
        f"estimated time per run: {1e3 * planned:.2f} ms ({1e3 * lowered:.2f} ms as its "
        "programs were lowered)" in text
    )
    data = inspect_json(manifest)
    assert data["verify"]["max_relative_diff"] <= 1e-4 and data["replanned"] == []
    assert [r["device_bytes"] for r in data["ranks"]] == [16 << 30] * 2

    edited = json.loads(json.dumps(manifest.to_json()))
    edited["plan"]["replanned"] = [
        {"node": "mm_3", "op": "aten.mm.default", "strategy": "S(1), S(0) -> P", "reason": "why"}
    ]
    del edited["plan"]["verify"]
    text = format_plan(Manifest.from_json(edited, "edited"))
    assert "re-planned (strategies the lowering could not run, dropped)" in text
    assert "  mm_3 (aten.mm.default): S(1), S(0) -> P: why" in text
    assert "checked against eager: no" in text
    edited["plan"]["ranks"][0]["peak_bytes"] = "1 GiB"  # what inspect shows has its type
    with pytest.raises(PackageError, match=r"plan.ranks\[0\].peak_bytes: expected an integer"):
        Manifest.from_json(edited, "edited")
    edited = json.loads(json.dumps(manifest.to_json()))
    edited["plan"]["lowered_time_s"] = "fast"
    with pytest.raises(PackageError, match=r"plan.lowered_time_s: expected a finite number"):
        Manifest.from_json(edited, "edited")
    # the report is a closed format: a key this tessel does not write is refused, not dropped
    edited = json.loads(json.dumps(manifest.to_json()))
    edited["plan"]["memory"]["spare_bytes"] = 1
    with pytest.raises(PackageError, match=r"plan.memory: unknown key 'spare_bytes'"):
        Manifest.from_json(edited, "edited")
    # and it reads back as it was written
    assert Manifest.from_json(manifest.to_json(), "again").plan == plan


def test_inspect_says_why_each_replicated_weight_is_replicated(gpt2_package, capsys, tmp_path):
    """The small GPT-2 on two devices of 16 GiB is replicated whole: each weight says that
    sharding it is estimated slower and memory allows the replicas, by the planner's costs."""
    from tessel.package import Package, PackageError
    from tessel.package.manifest import Manifest
    from tessel.package.plan_report import REPLICATION_REASONS
    from tessel.plan.why import REASONS

    assert REPLICATION_REASONS == REASONS  # the manifest reads what the planner writes
    assert main(["inspect", "--json", str(gpt2_package)]) == 0
    data = json.loads(capsys.readouterr().out)
    why = data["replicated"]
    placed = {name: p for params in data["layers"].values() for name, p in params.items()}
    # every weight replicated on the tp axis has a reason, and no sharded one
    assert set(why) == {name for name, p in placed.items() if p == ["R"]}
    assert len(why) > len(placed) / 2
    down = why["lm.transformer.h.0.mlp.c_proj.weight"]
    assert down["reason"] == "faster" and down["axes"] == ["tp"]
    assert down["slower_s"] > 0 and down["sharded_fits"] is True
    assert any(p.startswith("S(") for p in down["sharded"]) and down["saves_bytes"] > 0
    # identical layers share one placement, so one reason
    assert why["lm.transformer.h.1.mlp.c_proj.weight"] == down
    assert f"estimated {down['slower_s'] * 1e3:.3f} ms per run faster" in down["text"]
    assert "memory allows the replicas" in down["text"]

    assert main(["inspect", str(gpt2_package)]) == 0
    text = capsys.readouterr().out
    section = text.split("why weights are replicated")[1].split("\nper device (peak")[0]
    assert f"    mlp.c_proj.weight: {down['text']}" in section
    assert "lm.transformer.h.0 .. lm.transformer.h.1 (2 layers)" in section
    page = tmp_path / "plan.html"
    assert main(["inspect", str(gpt2_package), "--html", str(page)]) == 0
    assert "why replicated" in page.read_text()

    edited = json.loads(json.dumps(Package.open(gpt2_package).manifest.to_json()))
    edited["plan"]["replicated"]["lm.lm_head.weight"]["reason"] = "because"
    with pytest.raises(PackageError, match=r"replicated\['lm.lm_head.weight'\].reason: found"):
        Manifest.from_json(edited, "edited")
    edited["plan"]["replicated"]["lm.lm_head.weight"]["reason"] = "faster"
    edited["plan"]["replicated"]["lm.lm_head.weight"]["slower_s"] = "1 ms"
    with pytest.raises(PackageError, match=r"slower_s: expected a finite number"):
        Manifest.from_json(edited, "edited")


def test_a_worker_error_is_one_line_and_its_traceback_shows_at_debug(gpt2_package, tmp_path):
    import zipfile

    bad = tmp_path / "altered.tessel"
    with zipfile.ZipFile(gpt2_package) as zin, zipfile.ZipFile(bad, "w") as zout:
        for name in zin.namelist():
            data = bytearray(zin.read(name))
            if name.startswith("weights/"):
                data[-1] ^= 0xFF
            zout.writestr(name, bytes(data))
    run = subprocess.run(
        TESSEL + ["run", str(bad)], env=subprocess_env(), capture_output=True, text=True
    )
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert re.fullmatch(
        r"tessel: error: rank [01] failed: PackageError: .*fails its checksum: the file was altered",
        lines[0],
    )
    debug = subprocess.run(
        TESSEL + ["--log=debug", "run", str(bad)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1].startswith("tessel: error: rank ")


FAILING_BUILD = """
import sys
sys.path.insert(0, {root!r})
import tessel
from tests.conftest import small_llama, token_ids

tessel.build(small_llama(layers=1), (token_ids(),), cluster=2)
raise ValueError("this script fails after a build")
"""


def test_an_error_after_a_build_is_not_prefixed_by_rank(tmp_path):
    """Lowering traces ranks under a fake process group; an error after it reads as usual."""
    script = tmp_path / "fails.py"
    script.write_text(FAILING_BUILD.format(root=str(ROOT)))
    run = subprocess.run(
        [sys.executable, str(script)], env=subprocess_env(), capture_output=True, text=True
    )
    assert run.returncode == 1
    assert "ValueError: this script fails after a build" in run.stderr
    assert "[rank" not in run.stderr, run.stderr


def _bad_inputs(directory: Path) -> dict[str, tuple[Path, str]]:
    """Input files `tessel run` must refuse, each with the words its one-line error holds."""
    text = directory / "notes.safetensors"
    text.write_text("these are not tensors")
    empty = directory / "empty.safetensors"
    empty.write_bytes(b"")
    floats = directory / "floats.safetensors"
    save_file({"input_0": torch.zeros(2, 16)}, str(floats))
    short = directory / "short.safetensors"
    save_file({"input_0": torch.zeros(2, 8, dtype=torch.int64)}, str(short))
    other = directory / "other.safetensors"
    save_file({"ids": torch.zeros(2, 16, dtype=torch.int64)}, str(other))
    return {
        "text": (text, "not a safetensors file (Error while deserializing header"),
        "empty": (empty, "not a safetensors file (Error while deserializing header"),
        "dtype": (
            floats,
            "input_0: expected shape [2, 16] int64 (the model's input 'input_ids'), "
            "found [2, 16] float32",
        ),
        "shape": (short, "input_0: expected shape [2, 16] int64"),
        "missing": (other, "missing tensors ['input_0']; expected ['input_0']"),
        "absent": (directory / "absent.safetensors", "no such file"),
        "directory": (directory, "cannot read it"),
    }


def test_run_refuses_bad_inputs_with_one_line_naming_the_file(gpt2_package, tmp_path, capsys):
    for case, (path, words) in _bad_inputs(tmp_path).items():
        assert main(["run", str(gpt2_package), "--inputs", str(path)]) == 2, case
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, (case, lines)
        assert lines[0].startswith(f"tessel: error: {path}: {words}"), (case, lines[0])


def test_the_command_line_starts_without_torch():
    """Importing the CLI, building its parser (every subcommand's flags) and setting up logging
    import neither torch nor the builder: a subcommand imports what it needs when it runs."""
    code = (
        "import sys\n"
        "from tessel.cli import _configure_logging, make_parser\n"
        "make_parser().parse_args(['ckpt', 'ranks', '0'])\n"
        "_configure_logging('info')\n"
        "heavy = sorted(m for m in ('torch', 'tessel.builder') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr


def test_the_report_gives_the_other_ranks_peak_where_it_differs_from_rank_0s():
    from tessel.package.plan_report import MemoryLine
    from tessel.report import _memory_lines

    memory = {"weight_bytes": 1 << 20, "peak_bytes": 3 << 20, "device_bytes": 4 << 20}
    line = _memory_lines(MemoryLine(**memory, other_ranks_peak_bytes=2 << 20))[1]
    assert ", peak 3.00 MiB, other ranks' peak (no outputs gathered to them) 2.00 MiB, " in line
    assert (
        "other ranks" not in _memory_lines(MemoryLine(**memory, other_ranks_peak_bytes=3 << 20))[1]
    )
