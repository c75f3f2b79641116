"""`tessel demo` / `make demo`: tessel's main job on the embedded default.

A small Llama (transformers, random weights) is built for a local cluster of CPU devices whose
memory cannot hold the replicated weights, so the planner must shard them; the offline model is
loaded on one worker per device, run, and checked against the single-device model.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from tessel.builder import build
from tessel.capture import CapturedModel, capture
from tessel.config.cluster import cluster_from_dict, local_cluster_dict
from tessel.plan import has_rule
from tessel.plan.planner import least_memory_plan
from tessel.report import format_plan
from tessel.runtime import Session, finalize, initialize


def llama_config(
    layers: int, hidden: int = 256, heads: int = 8, kv_heads: int | None = None, vocab: int = 8192
):
    """A Llama config of the given size (MLP 4x wide, untied head), for demos, tests, benchmarks."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def demo_model(layers: int, hidden: int = 256, heads: int = 8, vocab: int = 8192):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(layers, hidden, heads, vocab=vocab)).eval()


def weight_bytes(captured: CapturedModel) -> int:
    """Bytes of the model's weights, buffers and constants, each tensor counted once."""
    ep = captured.program
    tensors = {id(t): t for t in (*ep.state_dict.values(), *ep.constants.values())}
    return sum(
        t.numel() * t.element_size() for t in tensors.values() if isinstance(t, torch.Tensor)
    )


def tight_cluster(
    captured: CapturedModel, devices: int, share: float = 1.15, slack: float = 0.05
) -> dict:
    """A local CPU cluster whose devices hold `share`/N of the weights plus the activations of
    the plan that needs the least memory (or that plan's peak, where it keeps more than that
    share of the weights), and `slack` of that peak for what lowered programs hold beyond the
    memory model's count: too little for replicated weights."""
    peak, weights = least_memory_plan(captured, devices)
    room = max(0, int(share * weight_bytes(captured) / devices) - weights)
    data = local_cluster_dict(devices)
    data["item_def"][0]["memory"] = f"[DDR:{peak + room + int(slack * peak)}B]"
    return data


def run_demo(devices: int = 4, layers: int = 4) -> int:
    torch.manual_seed(0)
    model = demo_model(layers)
    input_ids = torch.randint(0, model.config.vocab_size, (4, 128))
    kwargs = {"input_ids": input_ids, "use_cache": False}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"model: Llama, {layers} layers, {weights / 2**20:.1f} MiB of fp32 weights; input {list(input_ids.shape)}"
    )

    t = time.perf_counter()
    captured = capture(model, kwargs, keep=has_rule)
    capture_s = time.perf_counter() - t
    cluster = cluster_from_dict(
        tight_cluster(captured, devices),
        "<embedded demo cluster>",
    )
    print(
        f"cluster: {devices} local CPU devices with {cluster.devices[0].memory_bytes / 2**20:.0f} MiB "
        "each (too small for replicated weights)"
    )
    built = build(captured, cluster=cluster)
    built.timings["capture"] = capture_s
    with tempfile.TemporaryDirectory(prefix="tessel-demo-") as tmp:
        path = built.save(Path(tmp) / "llama")
        print()
        print(format_plan(built.manifest))
        print()
        with torch.no_grad():
            reference = model(**kwargs).logits
        initialize()
        try:
            session = Session()
            t = time.perf_counter()
            session.load_graph(0, {}, path)
            load_s = time.perf_counter() - t
            times = []
            for _ in range(5):
                t = time.perf_counter()
                (logits,) = session.run_graph(0, [input_ids])
                times.append(time.perf_counter() - t)
        finally:
            finalize()
    t = time.perf_counter()
    with torch.no_grad():
        model(**kwargs)
    eager_s = time.perf_counter() - t
    diff = (logits - reference).abs().max().item()
    print(f"load_graph on {devices} workers: {load_s:.2f} s")
    print(
        f"run_graph: median {1e3 * sorted(times)[2]:.1f} ms; single-process eager: {1e3 * eager_s:.1f} ms"
    )
    print(f"max abs diff against the single-device model: {diff:.2e}")
    ok = diff <= 1e-4
    print("demo: OK" if ok else "demo: MISMATCH")
    return 0 if ok else 1
