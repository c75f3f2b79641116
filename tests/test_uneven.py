"""Any device count: dimensions that do not divide are split as torch.chunk splits them."""

from __future__ import annotations

import torch
from tests.conftest import LogitsOnly, token_ids

import tessel
from tessel.capture import capture
from tessel.config.cluster import cluster_from_dict
from tessel.demo import tight_cluster, weight_bytes
from tessel.plan import has_rule


def _build_tight(model, ids, devices):
    captured = capture(model, (ids,), keep=has_rule)
    cluster = cluster_from_dict(tight_cluster(captured, devices), "tight.json")
    built = tessel.build(captured, cluster=cluster)  # checks itself against eager
    share = max(r.weight_bytes for r in built.manifest.plan.ranks) / weight_bytes(captured)
    return captured, built, share


def test_28_heads_and_4_kv_heads_on_8_devices():
    """Qwen2-7B's head counts, which divide neither by 8: attention is sharded by whole heads
    only (`tests/plan/test_strategies.py`), and the plan still holds 1/8 of the weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=256,
        hidden_size=28 * 4,
        intermediate_size=224,
        num_hidden_layers=2,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LogitsOnly(Qwen2ForCausalLM(cfg)).eval()
    ids = token_ids(2, 8)
    _, built, share = _build_tight(model, ids, 8)
    assert built.manifest.plan.verify.max_relative_diff <= 1e-4
    assert share <= 1.15 / 8, share


def test_gpt2_vocabulary_of_50257_on_4_devices(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50257, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    model = LogitsOnly(GPT2LMHeadModel(cfg)).eval()
    ids = token_ids(4, 8, vocab=50257)
    _, built, share = _build_tight(model, ids, 4)
    assert share <= 1.15 / 4, share
    embedding = built.manifest.plan.layers["(outside layers)"]["lm.transformer.wte.weight"]
    assert embedding in (("S(0)",), ("S(1)",))  # the 12.3 MiB table is never replicated
    # the 6.4 MB of logits, the largest tensor, reach rank 0 once (a gather of uneven shards
    # into one buffer, not an all-gather of padded ones and a copy); no other rank holds them
    logits = 4 * 8 * 50257 * 4
    for r in built.manifest.plan.ranks:
        held = r.peak_bytes - r.weight_bytes
        assert held < (1.5 if r.rank == 0 else 1.0) * logits, (r.rank, held, logits)
    path = tessel.save(built, tmp_path / "gpt2")
    other = token_ids(4, 8, vocab=50257, seed=5)
    with torch.no_grad():
        want = model(other)
    tessel.initialize()
    try:
        session = tessel.Session()
        session.load_graph(0, {}, path)
        (got,) = session.run_graph(0, [other])
    finally:
        tessel.finalize()
    assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())


def test_cohere_at_3_devices_where_a_gathered_value_is_viewed():
    """Cohere's attention output is viewed after a transpose; gathered whole at 3 devices, the
    value must keep the captured layout for the view to be taken as planned."""
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    cfg = CohereConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LogitsOnly(CohereForCausalLM(cfg)).eval()
    _, built, _ = _build_tight(model, token_ids(1, 16), 3)
    plan = built.manifest.plan
    assert plan.verify.max_relative_diff <= 1e-4
    assert not [r for r in plan.replanned if r.op == "aten.view.default"], plan.replanned
