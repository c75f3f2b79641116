"""Models larger than the build machine: a Llama built on the meta device, its weights streamed
from a `save_pretrained` checkpoint (sharded, with an index) into the package, run against the
same model loaded normally; names, shapes and dtypes that do not match are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.conftest import LogitsOnly, hf_llama, token_ids

import tessel
from tessel.capture import capture
from tessel.cli import main
from tessel.config.cluster import cluster_from_dict
from tessel.config.errors import ConfigError
from tessel.demo import tight_cluster
from tessel.plan import has_rule


def _meta_llama() -> torch.nn.Module:
    with tessel.empty_weights():
        return LogitsOnly(hf_llama()).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "llama"
    hf_llama().save_pretrained(folder, max_shard_size="100KB")  # several shards and an index
    return folder


def test_a_meta_model_streamed_from_a_sharded_checkpoint_equals_the_loaded_model(checkpoint):
    assert (checkpoint / "model.safetensors.index.json").is_file()
    loaded = LogitsOnly(hf_llama()).eval()
    ids = token_ids()
    with torch.no_grad():
        expected = loaded(ids)
    # devices too small for replicated weights, three of them: boxes of uneven size are read
    cluster = cluster_from_dict(tight_cluster(capture(loaded, (ids,), keep=has_rule), 3), "t")
    model = _meta_llama()
    assert all(p.device.type == "meta" for p in model.parameters())
    built = tessel.build(model, (ids,), cluster=cluster, weights=checkpoint)
    assert "weights streamed from" in built.manifest.plan.verify.skipped
    path = built.save(checkpoint.parent / "llama")
    tessel.initialize()
    try:
        session = tessel.Session()
        session.load_graph(0, {}, path)
        (out,) = session.run_graph(0, [ids])
    finally:
        tessel.finalize()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # each rank holds a third of a sharded weight, read from the checkpoint
    sizes = [r.weight_bytes for r in built.manifest.plan.ranks]
    whole = sum(p.numel() * 4 for p in loaded.parameters())
    assert max(sizes) < 0.5 * whole


def _single_file(checkpoint, tmp_path, change) -> str:
    tensors = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(file))
    change(tensors)
    folder = tmp_path / "one"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    with pytest.raises(ConfigError) as info:
        tessel.build(_meta_llama(), (token_ids(),), cluster=2, weights=folder)
    return str(info.value)


def test_a_missing_tensor_is_named(checkpoint, tmp_path):
    message = _single_file(checkpoint, tmp_path, lambda t: t.pop("model.norm.weight"))
    assert "lacks lm.model.norm.weight, which the model holds on the meta device" in message
    assert "after removing 'lm.'" in message


def test_a_tensor_the_model_lacks_is_named(checkpoint, tmp_path):
    message = _single_file(checkpoint, tmp_path, lambda t: t.update(extra=torch.ones(2)))
    assert "holds extra, which the model does not have" in message


def test_a_shape_or_dtype_that_differs_is_named(checkpoint, tmp_path):
    def half(t):
        t["model.norm.weight"] = t["model.norm.weight"].half()

    message = _single_file(checkpoint, tmp_path, half)
    assert (
        "model.norm.weight: is float16[64], but the model's lm.model.norm.weight is float32[64]"
        in (message)
    )


def test_buffers_left_on_the_meta_device_are_named(checkpoint):
    with torch.device("meta"):  # buffers too: the rotary tables are in no checkpoint
        model = LogitsOnly(hf_llama()).eval()
    with pytest.raises(ConfigError, match="lacks lm.model.rotary_emb.inv_freq"):
        tessel.build(model, (token_ids(),), cluster=2, weights=checkpoint)


def test_streamed_weights_cannot_be_verified_and_need_a_module(checkpoint):
    with pytest.raises(ConfigError, match="verify: needs the model's weights in memory"):
        tessel.build(_meta_llama(), (token_ids(),), cluster=2, weights=checkpoint, verify=True)
    with pytest.raises(ConfigError, match="a checkpoint directory|neither a directory"):
        tessel.build(_meta_llama(), (token_ids(),), cluster=2, weights=checkpoint / "nothing")


def test_the_command_line_streams_weights(checkpoint, tmp_path, capsys):
    spec = tmp_path / "model.py"
    spec.write_text(
        "import tessel\n"
        "from tests.conftest import LogitsOnly, hf_llama, token_ids\n\n"
        "def make():\n"
        "    with tessel.empty_weights():\n"
        "        return LogitsOnly(hf_llama()).eval(), (token_ids(),)\n"
    )
    cluster = tmp_path / "c.json"
    from tessel.config.cluster import local_cluster_dict

    cluster.write_text(json.dumps(local_cluster_dict(2)))
    args = [
        "build",
        f"--model={spec}:make",
        f"--weights={checkpoint}",
        "--distributed_cluster_build=1",
        f"--cluster_config={cluster}",
        f"--output={tmp_path / 'm'}",
    ]
    assert main(args) == 0, capsys.readouterr().err
    assert (tmp_path / "m.tessel").is_file()
