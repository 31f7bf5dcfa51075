from radixserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama block with a bias on the Q/K/V projections."""

    qkv_bias = True
