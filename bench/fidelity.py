"""Fidelity on real weights: does radixserve compute what the model computes? The demo model (SmolLM2-135M-Instruct)
through radixserve's offline Engine, greedy, in fp32 and bf16, checked by HF transformers in fp32.

    python -m bench.fidelity --device cuda                    # 256 prompts x 64 tokens (the figure to keep)
    python -m bench.fidelity --device cpu --prompts 32        # a few minutes on a CPU
    python -m bench.fidelity --device cuda --system-prompts 4 \
        --modes float32,bfloat16,float32+shared-prefix,bfloat16+shared-prefix   # the shared-prefix decode path

The measure, per mode: radixserve generates 64 tokens greedily for each prompt (ignore_eos, so every prompt gives 64
positions); HF fp32 then reads prompt + those tokens in one forward (teacher forcing) and we count the positions
where its argmax is the token radixserve chose. Teacher forcing keeps one early disagreement from turning the rest
of a sequence into a comparison of two different texts. fp32 should agree everywhere; bf16 rounds, so the bar for it
is HF's own bf16 on the same measure (HF bf16 greedy outputs, checked by HF fp32), printed alongside.
With --system-prompts N every prompt gets one of N long system messages (~700 tokens each, so that the requests
sharing one run as a group of the shared-prefix decode path), and a mode "DTYPE+shared-prefix" runs radixserve with
shared-prefix decode attention (a plain "DTYPE" mode runs with --disable-shared-prefix-attention): the grouped
kernels must agree with HF exactly as well as the plain ones do.
Writes a JSON record with the command, machine, date and figures."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from radixserve import Engine, SamplingParams
from radixserve.testing import smollm2_dir

SUBJECTS = [
    "the moon",
    "bread",
    "rivers",
    "chess",
    "volcanoes",
    "bees",
    "the printing press",
    "glaciers",
    "electric motors",
    "tea",
    "octopuses",
    "bridges",
    "the Roman empire",
    "rainbows",
    "compost",
    "jazz",
]
ASKS = [
    "Explain {} to a ten-year-old.",
    "Write a short poem about {}.",
    "What are three facts about {}?",
    "Why do people find {} interesting?",
    "Describe {} in one paragraph.",
    "What is the history of {}?",
    "Give me a quiz question about {}.",
    "How would you teach a class about {}?",
    "List some common misconceptions about {}.",
    "Compare {} with something from everyday life.",
    "Tell a story that involves {}.",
    "What would a scientist say about {}?",
    "Summarize {} in two sentences.",
    "What questions do children ask about {}?",
    "Write a haiku about {}.",
    "How has {} changed over time?",
]


PLACES = [
    "a science museum",
    "a public library",
    "a primary school",
    "a botanical garden",
    "a city archive",
    "a radio station",
    "a cooking school",
    "a maritime museum",
]


def system_message(place: str) -> str:
    """A long system prompt in the style of a deployed assistant's (~700 tokens): many requests share it."""
    rules = [
        f"Rule {i + 1}: when a visitor asks about {subject}, answer in plain words, name one thing they could "
        f"see or try at {place}, and keep the answer short enough to read aloud in a minute."
        for i, subject in enumerate(SUBJECTS)
    ]
    return (
        f"You are the assistant of {place}. You answer visitors' questions politely and truthfully. "
        + " ".join(rules)
        + f" Never invent opening hours or prices; send visitors to the front desk of {place} "
        "for those. If a question is unclear, ask one short question back."
    )


def chat_prompts(tokenizer, n: int, system_prompts: int = 0) -> list[list[int]]:
    pairs = list(itertools.product(ASKS, SUBJECTS))  # 256 distinct questions
    if n > len(pairs):
        raise SystemExit(f"--prompts is at most {len(pairs)}")
    if system_prompts > len(PLACES):
        raise SystemExit(f"--system-prompts is at most {len(PLACES)}")
    # Spread over subjects and question forms alike when n is small.
    chosen = [pairs[(i * 17) % len(pairs)] for i in range(n)]
    prompts = []
    for i, (ask, subject) in enumerate(chosen):
        messages = [{"role": "user", "content": ask.format(subject)}]
        if system_prompts:
            messages.insert(0, {"role": "system", "content": system_message(PLACES[i % system_prompts])})
        prompts.append(
            list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        )
    return prompts


def radixserve_greedy(
    model_dir: Path, device: str, mode: str, prompts: list[list[int]], new_tokens: int, watchdog_timeout: float | None
) -> tuple[list[list[int]], dict]:
    """Greedy tokens of one mode ("float32", "bfloat16+shared-prefix", ...) and the engine's cache statistics."""
    dtype, _, variant = mode.partition("+")
    if variant not in ("", "shared-prefix"):
        raise SystemExit(f"unknown mode {mode!r}: a dtype, optionally with +shared-prefix")
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    with Engine(
        str(model_dir),
        device=device,
        dtype=dtype,
        watchdog_timeout=watchdog_timeout,
        disable_shared_prefix_attention=variant != "shared-prefix",
    ) as engine:
        results = engine.generate(prompts, params)
        info = engine.server_info()
    for r in results:
        if r.error is not None or len(r.token_ids) != new_tokens:
            raise RuntimeError(f"radixserve {mode}: {r.finish_reason} after {len(r.token_ids)} tokens: {r.error}")
    return [r.token_ids for r in results], info


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], new_tokens: int, device: str, batch: int) -> list[list[int]]:
    """Plain argmax decoding with HF's KV cache, never stopping at EOS (like ignore_eos; HF's generate() with
    min_new_tokens would mask EOS instead, which changes the argmax). Batched, prompts padded on the left and masked
    out: one sequence at a time took 2 s per token in bf16 on a CPU."""
    outputs = []
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        width = max(map(len, group))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        tokens = []
        for _ in range(new_tokens):
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(next_ids)
            mask = torch.cat([mask, torch.ones_like(next_ids)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(
                input_ids=next_ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        outputs += torch.cat(tokens, dim=1).tolist()
    return outputs


@torch.inference_mode()
def teacher_forced_agreement(
    reference, prompts: list[list[int]], generated: list[list[int]], device: str
) -> tuple[int, int, int]:
    """(positions where the reference's argmax is the generated token, positions, sequences that agree at every
    position), the reference reading prompt + generated tokens in one forward per sequence."""
    agree = total = whole = 0
    for prompt, tokens in zip(prompts, generated):
        ids = torch.tensor([prompt + tokens], device=device)
        logits = reference(ids).logits[0, len(prompt) - 1 : -1]  # position t predicts token t + 1
        hits = int((logits.argmax(-1).cpu() == torch.tensor(tokens)).sum())
        agree, total, whole = agree + hits, total + len(tokens), whole + (hits == len(tokens))
    return agree, total, whole


def machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} ({platform.node()})"
    return f"{platform.node()}: {os.cpu_count()} CPUs, {platform.machine()}, torch {torch.__version__}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--modes",
        default="float32,bfloat16",
        help="radixserve modes to check: a dtype, or DTYPE+shared-prefix for the grouped decode path",
    )
    parser.add_argument(
        "--system-prompts", type=int, default=0, help="give the prompts this many long shared system messages (0: none)"
    )
    parser.add_argument(
        "--watchdog-timeout",
        type=float,
        default=None,
        help="the Engine's --watchdog-timeout (default the server's); a busy shared CPU may need more",
    )
    parser.add_argument("--hf-batch", type=int, default=64, help="sequences per batch of HF's bf16 greedy decoding")
    parser.add_argument("--out", default=None, help="JSON record (default bench/results/fidelity-<device>.json)")
    ns = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = datetime.now(timezone.utc)
    model_dir = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = chat_prompts(tokenizer, ns.prompts, ns.system_prompts)
    hf32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(ns.device).eval()

    rows = {}
    for mode in ns.modes.split(","):
        t0 = time.monotonic()
        generated, info = radixserve_greedy(model_dir, ns.device, mode, prompts, ns.new_tokens, ns.watchdog_timeout)
        agree, total, whole = teacher_forced_agreement(hf32, prompts, generated, ns.device)
        rows[f"radixserve {mode}"] = {
            "agree": agree,
            "positions": total,
            "top1_agreement": agree / total,
            "sequences_all_agree": whole,
            "seconds": round(time.monotonic() - t0, 1),
            "shared_prefix_tokens_saved": info.get("shared_prefix_tokens_saved", 0),
        }
        print(
            f"radixserve {mode}: {agree}/{total} = {agree / total:.4%} ({whole}/{len(prompts)} sequences whole, "
            f"{info.get('shared_prefix_tokens_saved', 0)} KV tokens read once for a group)",
            flush=True,
        )
        if mode.endswith("+shared-prefix") and not info.get("shared_prefix_tokens_saved"):
            raise RuntimeError(f"{mode}: no decode ran grouped (are the shared system prompts long enough?)")

    t0 = time.monotonic()
    hf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(ns.device).eval()
    generated = hf_greedy(hf16, prompts, ns.new_tokens, ns.device, ns.hf_batch)
    agree, total, whole = teacher_forced_agreement(hf32, prompts, generated, ns.device)
    rows["HF transformers bfloat16 (reference bar)"] = {
        "agree": agree,
        "positions": total,
        "top1_agreement": agree / total,
        "sequences_all_agree": whole,
        "seconds": round(time.monotonic() - t0, 1),
    }
    print(f"HF bfloat16 (bar): {agree}/{total} = {agree / total:.4%} ({whole}/{len(prompts)} sequences whole)")

    import transformers

    record = {
        "command": shlex.join(["python", "-m", "bench.fidelity", *sys.argv[1:]]),
        "date_utc": started.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(ns.device),
        "device": ns.device,
        "model": "SmolLM2-135M-Instruct (radixserve.testing.smollm2_dir)",
        "prompts": len(prompts),
        "system_prompts": ns.system_prompts,
        "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts)),
        "new_tokens": ns.new_tokens,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "measure": "top-1 agreement of HF fp32 (teacher-forced) with each mode's greedy tokens",
        "results": rows,
    }
    out = Path(ns.out or f"bench/results/fidelity-{ns.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    # fp32 must agree everywhere; any other dtype at least as well as HF's own bf16 does.
    bar = rows["HF transformers bfloat16 (reference bar)"]["top1_agreement"]
    ok = all(
        row["top1_agreement"] == 1.0 if name.startswith("radixserve float32") else row["top1_agreement"] >= bar
        for name, row in rows.items()
        if name.startswith("radixserve ")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
