import torch, tessel, time
from tests.conftest import small_llama, token_ids
from tessel.capture import capture
from tessel.config.cluster import cluster_from_dict, local_cluster_dict
from tessel.plan.planner import captured_activation_bytes
import logging; logging.basicConfig(level=logging.INFO)
def main():
    N=4
    for vocab in (256, 250):
        model = small_llama(layers=2, hidden=128, heads=4, vocab=vocab)
        ids = token_ids(2, 32, vocab=vocab)
        captured = capture(model, (ids,))
        params = list(model.parameters())
        matrices = sum(p.numel() * 4 for p in params if p.dim() >= 2)
        vectors = sum(p.numel() * 4 for p in params if p.dim() < 2) + sum(b.numel() * b.element_size() for b in model.buffers())
        act = captured_activation_bytes(captured)
        data = local_cluster_dict(N)
        data["item_def"][0]["memory"] = f"[DDR:{act + matrices / N + vectors + 4096}B]"
        cluster = cluster_from_dict(data, "tight.json")
        t=time.time()
        built = tessel.build(captured, cluster=cluster)
        print(vocab, "programs", sorted({s["program"] for s in built.manifest["submodels"]}), built.timings)
        print(built.manifest["plan"]["layers"].get("(outside layers)"))
        path = tessel.save(built, f"/tmp/unev{vocab}")
        tessel.initialize(); s = tessel.Session(); s.load_graph(0, {}, path)
        (out,) = s.run_graph(0, [ids])
        with torch.no_grad(): ref = model(ids)
        print("diff", (out-ref).abs().max().item())
        tessel.finalize()
    
if __name__=='__main__':
    main()
