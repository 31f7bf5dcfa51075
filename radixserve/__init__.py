"""radixserve: an SGLang-style LLM serving engine with a radix prefix cache."""

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name):
    # Lazy, so that `import radixserve.protocol` in a light process does not pay for the engine's imports.
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    if name == "SamplingParams":
        from radixserve.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
