from radixserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: the Llama block with an RMSNorm over each head of Q and K before the rotary embedding."""

    qk_norm = True
