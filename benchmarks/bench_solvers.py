"""O1 (dynamic programming) against O2 (integer program): solve time and estimated time.

GPT-2 (width 768) and Llama (width 1024, 16 heads) at 8 and 32 layers, batch 8 x 512, planned
for 4 devices with 16 GB (memory to spare) and for 4 devices that barely hold the model (memory
priced into the solve). Both solvers get the same problem: the figures are the solve phase
(building the memory rows included, the same for both) and the plan's estimated time per run.

    python benchmarks/bench_solvers.py [--layers 8 32]
"""

from __future__ import annotations

import argparse

import torch


def gpt2(layers: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=768, n_head=12, n_layer=layers, vocab_size=50304, n_positions=1024)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval()


def llama(layers: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    from tessel.demo import llama_config

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(layers, 1024, 16, vocab=32000)).eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    args = parser.parse_args()

    from tessel.capture import capture
    from tessel.config.cluster import cluster_from_dict, local_cluster
    from tessel.config.parallel_option import ParallelOption
    from tessel.demo import tight_cluster
    from tessel.plan import has_rule, make_plan

    rows = []
    for name, make in (("gpt2", gpt2), ("llama", llama)):
        for layers in args.layers:
            model = make(layers)
            ids = torch.randint(0, 32000, (8, 512))
            captured = capture(model, {"input_ids": ids, "use_cache": False}, keep=has_rule)
            clusters = {
                "16 GB": local_cluster(4),
                "tight": cluster_from_dict(tight_cluster(captured, 4), "tight"),
            }
            for memory, cluster in clusters.items():
                found = {}
                for level in ("O2", "O1"):
                    plan = make_plan(captured, cluster, ParallelOption(opt_level=level))
                    found[level] = (plan.timings["solve"], plan.estimated_time)
                rows.append((name, layers, memory, found))
                print(rows[-1], flush=True)
            del model, captured
    print()
    print(
        f"{'model':<6} {'layers':>6} {'memory':<6} {'O2 solve s':>10} {'O1 solve s':>10} "
        f"{'O2 est ms':>9} {'O1 est ms':>9} {'O1/O2 est':>9}"
    )
    for name, layers, memory, found in rows:
        (s2, e2), (s1, e1) = found["O2"], found["O1"]
        print(
            f"{name:<6} {layers:>6} {memory:<6} {s2:>10.2f} {s1:>10.2f} {1e3 * e2:>9.2f} "
            f"{1e3 * e1:>9.2f} {e1 / e2:>9.4f}"
        )


if __name__ == "__main__":
    main()
