"""What a newcomer meets first: a `transformers` model built as they hold it, example inputs as
keywords, a `--model` file importing its neighbours, what a build says while it works and when
it is done, and a script without its main guard named before any worker starts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tests.conftest import ROOT, hf_llama, on_a_terminal, subprocess_env, token_ids

import tessel
from tessel.config.errors import ConfigError

MODEL_FILE = """
from neighbour import make  # a module beside this file, as `python model.py` would find it


def build():
    return make()
"""
NEIGHBOUR = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2)
    ids = torch.randint(0, 128, (2, 8))
    return LlamaForCausalLM(config), {"input_ids": ids}  # its cache on, as users hold it
"""
PROGRESS = "tessel: capturing the model: "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("model")
    (d / "model.py").write_text(MODEL_FILE)
    (d / "neighbour.py").write_text(NEIGHBOUR)
    return d


def _build_argv(model_dir: Path, output: Path) -> list[str]:
    return [
        sys.executable, "-m", "tessel.cli", "build", f"--model={model_dir / 'model.py'}:build",
        f"--output={output}", "--distributed_cluster_build=1", "--enable_graph_parallel=1",
        f"--cluster_config={ROOT / 'examples' / 'cluster_4p.json'}",
        f"--graph_parallel_option_path={ROOT / 'examples' / 'parallel_option.json'}",
    ]  # fmt: skip


def test_a_build_on_a_terminal_shows_each_phase_and_ends_with_its_summary(model_dir, tmp_path):
    code, text = on_a_terminal(_build_argv(model_dir, tmp_path / "out" / "m"), tmp_path)
    assert code == 0, text
    assert PROGRESS in text  # the phase's line, then its time
    assert "tessel: lowering the program of each of 4 ranks: " in text
    assert "built partitioned for 4 cpu devices" in text
    assert "outputs: logits float32[2, 8, 128]" in text  # the ModelOutput's field, named
    assert (tmp_path / "out" / "m.tessel").is_file()  # --output's parent made


def test_a_piped_build_prints_its_summary_and_no_progress_or_torch_warning(model_dir, tmp_path):
    done = subprocess.run(
        _build_argv(model_dir, tmp_path / "m"), cwd=tmp_path, env=subprocess_env(),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "built partitioned for 4 cpu devices, mesh tp 4", done.stdout
    for part in ("inputs: input_ids int64[2, 8]", "per device: weights", "collectives per run:"):
        assert part in done.stdout
    assert "checked against eager: max relative diff" in done.stdout
    assert lines[-1] == f"wrote {tmp_path / 'm.tessel'}"
    assert len(lines) < 25  # one screen
    assert "tessel:" not in done.stderr and "Warning" not in done.stderr, done.stderr
    assert done.stderr.strip() == "", done.stderr


def test_repr_of_a_build_is_its_summary_and_its_outputs_are_named():
    model, ids = hf_llama(layers=1, hidden=32, heads=2, kv_heads=2, vocab=64), token_ids(vocab=64)
    built = tessel.build(model, {"input_ids": ids}, cluster=2, verify=True)
    text = repr(built)
    assert text.startswith("built partitioned for 2 cpu devices"), text
    assert "outputs: logits float32[2, 16, 64]" in text
    assert "checked against eager: max relative diff" in text
    assert [o.name for o in built.manifest.outputs] == ["logits"]


def test_a_model_on_the_meta_device_without_weights_is_told_to_pass_them():
    from transformers import LlamaForCausalLM

    from tessel.demo import llama_config

    with tessel.empty_weights():
        model = LlamaForCausalLM(llama_config(1, 32, 2, vocab=64))
    with pytest.raises(ConfigError, match=r"weights: .*meta device.*--weights DIR"):
        tessel.build(model, (token_ids(vocab=64),), cluster=2)


UNGUARDED = """
import multiprocessing.context
import time

started = []
real_popen = multiprocessing.context.SpawnProcess._Popen
multiprocessing.context.SpawnProcess._Popen = staticmethod(
    lambda process: started.append(process) or real_popen(process)
)
import tessel

initialize = tessel.initialize  # imported here, so the time below is the check's alone
start = time.perf_counter()
try:
    initialize()
except tessel.TesselError as exc:
    print(f"refused after {time.perf_counter() - start:.4f} s, {len(started)} workers: {exc}")
"""


def test_a_script_without_its_main_guard_is_refused_before_any_worker_starts(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=subprocess_env(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert ", 0 workers: " in done.stdout, done.stdout
    assert f"{script}:15: tessel.initialize() runs at the script's top level" in done.stdout
    assert 'under `if __name__ == "__main__":`' in done.stdout


def test_the_guard_check_reads_the_calling_line(tmp_path, monkeypatch):
    from tessel.runtime import main_guard

    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            import tessel
            x = 1
            if __name__ == "__main__":
                main()
            if "__main__" == __name__:
                other()
            """
        )
    )
    guards = main_guard._guarded_lines(str(script))
    assert guards == ((5, 5), (7, 7))


def test_example_inputs_as_keywords_build_a_training_step():
    model = hf_llama(layers=1, hidden=32, heads=2, kv_heads=2, vocab=64).train()
    ids = token_ids(vocab=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    built = tessel.build(model, {"input_ids": ids, "labels": ids}, cluster=2, optimizer=opt)
    assert [i.name for i in built.manifest.inputs] == ["input_ids", "labels"]
