"""The scheduler's counters, shared by the components that count (batch building, admission, memory pressure,
layer-wise offload) and read by /server_info and the cache dashboard."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    steps: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens: int = 0
    cached_prompt_tokens: int = 0
    retractions: int = 0
    evicted_tokens: int = 0
    grouped_decodes: int = 0  # decode tokens whose attention read a shared prefix together with others
    shared_prefix_tokens_saved: int = 0  # tokens of KV per layer that grouping kept from being read again
    incremental_decode_steps: int = 0  # steps built by advancing the last batch of decodes (decode_batch.py)
