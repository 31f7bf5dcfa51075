"""GPU check: three in-process engines built one after another in one process (a sequence that once hit a
device-side assert during CUDA-graph capture, before capture waited on the default stream), then a multi-process
Engine, on Qwen3-0.6B dummy weights; all must give the same greedy tokens. Exits 1 when they do not.

    python -m bench.two_engines_gpu [--tokenizer .gpu_models/qwen3-tokenizer]
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from radixserve.engine import Engine
from radixserve.sampling import SamplingParams
from radixserve.testing.tiny_models import dummy_config_dir
from scheduler_service.in_process_engine import InProcessEngine

from bench.run_record import run_record


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", default=".gpu_models/qwen3-tokenizer", help="a Qwen3 tokenizer directory")
    ns = parser.parse_args()
    record = run_record()
    print(f"{record['date']}  {record['gpu']}  {record['command']}  (commit {record['git_commit']})")
    model_dir = str(dummy_config_dir("qwen3-0.6b", ns.tokenizer))
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    prompts = [[100 + i] * 300 for i in range(64)]
    outs = []
    for i in range(3):
        engine = InProcessEngine(model_dir, load_format="dummy", device="cuda")
        outs.append([r.token_ids for r in engine.generate(prompts, params)])
        engine.scheduler.check_invariant()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        print("in-process engine", i, "ok", flush=True)
    with Engine(model_dir, load_format="dummy", device="cuda") as engine:
        outs.append([r.token_ids for r in engine.generate(prompts, params)])
    identical = all(o == outs[0] for o in outs)
    print("identical across the four engines:", identical)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
