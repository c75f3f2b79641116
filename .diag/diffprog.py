import torch, json
from tests.conftest import small_gpt2, token_ids
from tessel.capture import capture
from tessel.config.cluster import local_cluster
from tessel.config.parallel_option import ParallelOption
from tessel.plan import make_plan
from tessel.lower.trace import lower_rank
import sys; sys.path.insert(0,"benchmarks"); from bench_build import gpt2; m = gpt2(1)
ids = torch.randint(0, 50304, (8, 64))
c = capture(m, {"input_ids": ids, "use_cache": False})
plan = make_plan(c, local_cluster(4, "cpu"), ParallelOption(), 60)
a = lower_rank(c, plan, 0); b = lower_rank(c, plan, 3)
ja = json.dumps(a.program, indent=0).splitlines(); jb = json.dumps(b.program, indent=0).splitlines()
import difflib
print("\n".join(list(difflib.unified_diff(ja, jb, lineterm=""))[:60]))
print(a.constants.keys(), b.constants.keys())
