"""GPU check: three in-process engines built one after another in one process (a sequence that once hit a
device-side assert during CUDA-graph capture, before capture waited on the default stream), then a multi-process
Engine, on Qwen3-0.6B dummy weights; all must give the same greedy tokens.

    python3 bench/two_engines_gpu.py   (tokenizer files expected in .gpu_models/qwen3-tokenizer)
"""
import gc
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/kernels.py would shadow the kernels package

import torch  # noqa: E402
from radixserve.engine import Engine, InProcessEngine  # noqa: E402
from radixserve.sampling import SamplingParams  # noqa: E402
from radixserve.testing.tiny_models import dummy_config_dir  # noqa: E402
d = str(dummy_config_dir("qwen3-0.6b", sys.argv[1] if len(sys.argv) > 1 else ".gpu_models/qwen3-tokenizer"))
p = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
prompts = [[100 + i] * 300 for i in range(64)]
outs = []
for i in range(3):
    e = InProcessEngine(d, load_format="dummy", device="cuda")
    outs.append([r.token_ids for r in e.generate(prompts, p)])
    e.scheduler.check_invariant()
    del e
    gc.collect(); torch.cuda.empty_cache()
    print("in-process engine", i, "ok", flush=True)
with Engine(d, load_format="dummy", device="cuda") as e:
    outs.append([r.token_ids for r in e.generate(prompts, p)])
print("identical across the four engines:", all(o == outs[0] for o in outs))
