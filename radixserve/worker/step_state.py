"""What a step carries between the model runner's stages (radixserve/worker/model_runner.py): StepInputs, the batch
unpacked once (prepare -> run_model -> logits), and SampledStep, tokens sampled on the device and not yet read back
(sample -> finish_step; step_pipeline.py holds one in flight)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.forward_context import ForwardContext
from radixserve.layers.sampler import SamplingRequestState
from radixserve.protocol import ForwardBatch


def batch_positions(prefix_lens: np.ndarray, extend_lens: np.ndarray) -> np.ndarray:
    """Position of every new token: prefix_lens[i] + 0..extend_lens[i]-1, concatenated."""
    starts = np.cumsum(extend_lens) - extend_lens
    return (np.repeat(prefix_lens - starts, extend_lens) + np.arange(int(extend_lens.sum()))).astype(np.int64)


@dataclass
class StepInputs:
    """A ForwardBatch unpacked once (ModelRunner.prepare): host arrays, device tensors, the attention layout."""

    batch: ForwardBatch
    rows: np.ndarray  # int32 req_to_token rows, batch order
    prefix_lens: np.ndarray
    extend_lens: np.ndarray
    extend_start: np.ndarray  # each request's first new token in the flat batch
    input_ids: torch.Tensor  # int64 [T], placeholders resolved
    positions: torch.Tensor  # int64 [T]
    last_index: torch.Tensor  # int64 [B]: each request's last new token
    ctx: ForwardContext | None
    decode_graph: bool = False  # decodes alone, replayed as one decode CUDA graph: then the host arrays below,
    seq_lens: np.ndarray | None = None  # and input_ids / positions on the host too
    new_slots: np.ndarray | None = None


@dataclass
class SampledStep:
    """A step whose tokens are sampled on the device but not yet read back (ModelRunner.sample -> finish_step)."""

    step: int
    tokens: torch.Tensor | None  # on the host (pinned, being copied on a GPU); None: nothing sampled this step
    logprobs: tuple | None  # on the host likewise: (chosen [B], top values [B, k], top ids [B, k]), or None
    states: list[SamplingRequestState]
    done: "torch.cuda.Event | None" = None  # recorded after the copies to the host (GPU): query() tells if they ran
    prompt_logprobs: list = field(default_factory=list)  # PromptLogprobs computed by this step's forward

    def ready(self) -> bool:
        return self.done is None or self.done.query()
