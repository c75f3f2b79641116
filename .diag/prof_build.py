import cProfile, pstats, sys, time, os, tempfile
import torch
sys.path.insert(0, "benchmarks")
from bench_build import gpt2
import tessel
L = int(sys.argv[1])
model = gpt2(L)
ids = torch.randint(0, 50304, (8, 512))
pr = cProfile.Profile()
t=time.perf_counter()
pr.enable()
built = tessel.build(model, {"input_ids": ids, "use_cache": False}, cluster=4)
with tempfile.TemporaryDirectory() as tmp:
    built.save(os.path.join(tmp, "g"))
pr.disable()
print("total", time.perf_counter()-t, built.timings)
pr.dump_stats(f"/tmp/prof{L}.out")
