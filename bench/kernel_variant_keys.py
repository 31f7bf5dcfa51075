"""Which Triton kernel variants a run launches, as the GPU's JIT would key them, found on the CPU.

Triton compiles one binary per specialization key of a kernel: its constexpr values, per int argument whether it is
1 (then a constant of the binary), divisible by 16 or neither, per pointer argument its dtype and whether its address
is 16-byte aligned, and the launch options (num_warps, num_stages). Arguments named in do_not_specialize keep only
their type, those in do_not_specialize_on_alignment drop the alignment. A key first met in the middle of serving is a
compile there (a second or more on an H100). Under TRITON_INTERPRET=1 nothing compiles, but the kernels run through
the same host code with the same arguments, so the keys can be computed exactly: this module hands every launch's
arguments to the binder Triton itself generates for a kernel (runtime/jit.py create_function_from_signature, with
the native specialize_impl and an sm_90 CUDA target), which needs no GPU. On a GPU it records compiled launches the
same way.

    with KernelVariants() as variants:       # in the process that launches the kernels
        variants.phase("warm-up"); run()
        variants.phase("timed"); run()
    variants.new_in("timed")                 # keys no earlier phase launched
"""

from __future__ import annotations

import inspect
import json
import os

LOG_ENV = "KERNEL_VARIANTS_LOG"
OPTIONS_ENV = "KERNEL_VARIANTS_OPTIONS"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_binders: dict = {}


def _cuda_backend():
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    return CUDABackend(GPUTarget("cuda", 90, 32))  # an H100; the specialization rules are not per architecture


def _binder(kernel):
    """Triton's own argument binder for this kernel (what JITFunction.run calls before it looks up its cache)."""
    fn = kernel.fn
    if fn not in _binders:
        from triton.runtime.jit import KernelParam, create_function_from_signature

        opts = getattr(kernel, "kwargs", None)  # InterpretedFunction keeps triton.jit's arguments here
        dns = (opts or {}).get("do_not_specialize") or getattr(kernel, "do_not_specialize", None) or []
        dns_oa = (
            (opts or {}).get("do_not_specialize_on_alignment")
            or getattr(kernel, "do_not_specialize_on_alignment", None)
            or []
        )
        sig = inspect.signature(fn)
        params = [
            KernelParam(i, p, i in dns or p.name in dns, i in dns_oa or p.name in dns_oa)
            for i, p in enumerate(sig.parameters.values())
        ]
        _binders[fn] = (create_function_from_signature(sig, params, _cuda_backend()), params)
    return _binders[fn]


def _describe(param, kind, attr) -> str:
    """One argument's part of the key, readable: constexprs by value, ints as ==1 / %16 / other / free (not
    specialised), pointers as 16B-aligned / unaligned / any-align (not specialised on alignment)."""
    if kind == "constexpr":
        return "=" + repr(attr)
    if kind.startswith("*"):
        if attr is None or param.do_not_specialize_on_alignment:
            return f":{kind} any-align"
        return f":{kind} {'16B-aligned' if attr == 'D' else 'unaligned'}"
    if attr is None:
        return f":{kind}" if kind[:2] in ("fp", "bf") or kind == "u1" else f":{kind} free"
    return f":{kind} {'%16' if attr == 'D' else 'other'}"


def specialization_key(kernel, args, kwargs) -> str:
    """The variant this launch selects, as 'kernel(arg=..., ...) options'; equal strings = one compiled binary."""
    binder, params = _binder(kernel)
    _, spec, options = binder(*args, **kwargs)
    parts = [f"{p.name}{_describe(p, kind, attr)}" for p, (kind, attr) in zip(params, spec)]
    opts = ", ".join(f"{k}={options[k]!r}" for k in sorted(options))
    return f"{kernel.fn.__name__}({', '.join(parts)}) [{opts}]"


# Where the attention kernels are defined (kernel.fn.__module__): the device-side modules beside their launchers.
ATTENTION_MODULES = (
    "kernels.triton_attention",
    "kernels.triton_attention_kernels",
    "kernels.shared_prefix_kernels",
)


def _graph_step(kernel, prefill_graph_max_tokens: int = 2048) -> str | None:
    """How an H100 runs this launch of the forward in flight, where a CUDA graph captured at start-up replays it
    (its variant compiled then): "decode" (a decode-only step of bs <= --cuda-graph-max-bs: one graph), "lone" (a
    prompt chunk alone of up to --prefill-cuda-graph-max-tokens: one graph of the whole forward, whose extend kernel
    reads its metadata from a static block at other alignments than an eager step's: prefill_cuda_graph.py),
    "piece" (a kernel between two attentions of another step of up to that many tokens: piecewise graphs); None:
    launched eagerly (attention in piecewise steps, every kernel of a larger step)."""
    from radixserve.forward_context import get_forward_context

    try:
        ctx = get_forward_context()
    except RuntimeError:
        return None
    tokens = ctx.out_cache_loc.shape[0]
    if ctx.num_extend_reqs == 0 and ctx.req_pool_indices.shape[0] <= 256:
        return "decode"
    if tokens > prefill_graph_max_tokens:
        return None
    if ctx.num_extend_reqs == 1 and ctx.num_extend_tokens == tokens:
        return "lone"
    attention = kernel.fn.__module__ in ATTENTION_MODULES and kernel.fn.__name__ != "_store_kv_kernel"
    return None if attention else "piece"


def compiled_for_h100(kernel, args, kwargs):
    """The variant this launch selects, compiled to an sm_90 cubin (Triton ships ptxas: no GPU needed): Triton's
    CompiledKernel, its PTX and SASS in .asm. Needs a compiled JITFunction kernel (not under TRITON_INTERPRET=1)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    binder, _ = _binder(kernel)
    bound, spec, options = binder(*args, **kwargs)
    opts, signature, constexprs, attrs = kernel._pack_args(_cuda_backend(), kwargs, bound, spec, options)
    return triton.compile(
        ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=opts.__dict__
    )


def compile_for_h100(kernel, args, kwargs) -> float:
    """Seconds to compile the variant this launch selects for an H100 (compiled_for_h100): the cost of meeting it
    first in the middle of serving (on this machine's CPU)."""
    import time

    start = time.perf_counter()
    compiled_for_h100(kernel, args, kwargs)
    return time.perf_counter() - start


class KernelVariants:
    """Context manager recording each kernel launch's specialization key, by phase (phase() starts a new one).

    shadow: launches are recorded but not run, and each kernels.* op is computed by its torch twin instead (kernel
    outputs never change a batch's makeup, and the twins are fast: GPU-sized workloads audit in minutes).
    h100: the wrappers choose block sizes and split counts as for bf16 on an H100 (132 SMs), so that the keys are
    those of a GPU run, and launches that an H100 replays from CUDA graphs count as start-up's (captured then:
    _graph_step), but for the extend kernel of a lone chunk's graph, whose variant no eager step selects.
    min_split_tokens: the split policies' shortest slice (scaled down with a CPU-sized workload).
    compile: each new variant is also compiled for sm_90 (compile_for_h100), its seconds kept in compile_seconds."""

    def __init__(
        self,
        log_path: str | None = None,
        shadow: bool = False,
        h100: bool = False,
        min_split_tokens: int | None = None,
        compile: bool = False,
    ):
        self.first_phase: dict[str, str] = {}  # key -> phase it was first launched in
        self.current = "start"
        self.log_path = log_path
        self.shadow, self.h100, self.min_split_tokens, self.compile = shadow, h100, min_split_tokens, compile
        self.compile_seconds: dict[str, float] = {}
        self._restore = []

    def phase(self, name: str) -> None:
        self.current = name

    def record(self, kernel, args, kwargs) -> None:
        key = specialization_key(kernel, args, kwargs)
        graph = _graph_step(kernel) if self.h100 else None
        if graph == "lone" and kernel.fn.__name__ == "_extend_kernel":
            return  # the graph's variant (metadata at its static block's alignments), never an eager step's
        if graph:
            # A CUDA graph replays this launch, and its capture at start-up compiled the kernel: the key counts as
            # met at start-up (an eager step of another batch makeup may select the same binary).
            self.first_phase.setdefault(key, "start-up (CUDA graph capture)")
            return
        if key not in self.first_phase:
            self.first_phase[key] = self.current
            if self.compile:
                self.compile_seconds[key] = round(compile_for_h100(kernel, args, kwargs), 2)
            if self.log_path:
                with open(self.log_path, "a") as f:
                    f.write(json.dumps({"key": key, "compile_seconds": self.compile_seconds.get(key)}) + "\n")

    def new_in(self, phase: str) -> list[str]:
        """The keys first launched in this phase: variants every earlier phase left to compile."""
        return sorted(k for k, p in self.first_phase.items() if p == phase)

    def _set(self, owner, name, value) -> None:
        """owner.name = value (owner[name] for a dict) until __exit__."""
        if isinstance(owner, dict):
            self._restore.append((owner, name, owner[name]))
            owner[name] = value
        else:
            self._restore.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    def __enter__(self) -> "KernelVariants":
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        for cls in (InterpretedFunction, JITFunction):

            def run(kernel, *args, grid, warmup, _original=cls.run, **kwargs):
                if not warmup:
                    self.record(kernel, args, kwargs)
                if self.shadow:
                    return None
                return _original(kernel, *args, grid=grid, warmup=warmup, **kwargs)

            self._set(cls, "run", run)
        if self.shadow:
            self._shadow_dispatch()
        if self.h100 or self.min_split_tokens:
            self._policy()
        return self

    def _shadow_dispatch(self) -> None:
        import torch
        import torch.nn.functional as F

        import kernels
        from kernels import (
            reference,
            shared_prefix_attention,
            triton_attention,
            triton_common,
            triton_elementwise,
            triton_mlp,
            triton_qkv,
            triton_skinny_linear,
            triton_step_inputs,
        )

        def skinny_twin(x, weight, squares=None, eps=0.0, residual=None):
            if residual is None:
                return F.linear(x if squares is None else reference.scale_rows(x, squares, eps), weight)
            h, sums = reference.linear_add(x, weight, residual)
            # As many sums as the kernel writes (one per column block): the next projection's variant key holds it.
            blocks = triton_skinny_linear.triton.cdiv(
                weight.shape[0], triton_skinny_linear.skinny_config(x.dtype, x.device)["BLOCK_N"]
            )
            return h, torch.cat([sums, sums.new_zeros(sums.shape[0], blocks - 1)], dim=1)

        twins = {"skinny_linear": skinny_twin}  # ops kernels/reference.py has no twin of

        class Shadow:
            """Each op: the Triton wrapper (its launches recorded, not run), then the torch twin (the result)."""

            def __init__(self, module):
                self.module = module

            def __getattr__(self, name):
                if name in ("skinny_supports", "launches_with_pdl"):  # questions, not ops
                    return getattr(fused, name)

                def op(*args, **kwargs):
                    getattr(self.module, name)(*args, **kwargs)
                    return (twins.get(name) or getattr(reference, name))(*args, **kwargs)

                return op

        self._set(kernels, "_attention_impl", lambda t: Shadow(triton_attention))
        self._set(kernels, "_elementwise_impl", lambda t: Shadow(triton_elementwise))
        self._set(kernels, "_shared_prefix_impl", lambda t: Shadow(shared_prefix_attention))
        self._set(kernels, "_step_inputs_impl", lambda t: Shadow(triton_step_inputs))
        fused = type(
            "Fused",
            (),
            {
                "qk_norm_rope_store": staticmethod(triton_qkv.qk_norm_rope_store),
                "gate_up_silu": staticmethod(triton_mlp.gate_up_silu),
                "skinny_linear": staticmethod(triton_skinny_linear.skinny_linear),
                "skinny_supports": staticmethod(triton_skinny_linear.supports),
                "launches_with_pdl": staticmethod(triton_common.linear_uses_pdl),
            },
        )
        self._set(kernels, "_fused_impl", lambda t: Shadow(fused))

    def _policy(self) -> None:
        import torch

        from kernels import shared_prefix_attention as spa, triton_attention as ta, triton_mlp
        from kernels import triton_skinny_linear as skinny

        if self.min_split_tokens:
            self._set(ta.DECODE_SPLITS, "min_split_tokens", self.min_split_tokens)
            self._set(spa.PREFIX_SPLITS, "min_split_tokens", self.min_split_tokens)
        if not self.h100:
            return
        gpu, bf16 = torch.device("cuda"), torch.bfloat16
        decode_config, extend_config, prefix_config = ta.decode_config, ta.extend_config, spa.prefix_config
        for module in (ta, spa, skinny):
            for name in ("sm_count", "_sm_count"):  # the latter: trees before kernels/triton_common.py
                if hasattr(module, name):
                    self._set(module, name, lambda device: 132)
        self._set(ta, "decode_config", lambda dtype, device: decode_config(bf16, gpu))
        mlp_config = triton_mlp.gate_up_config
        self._set(triton_mlp, "gate_up_config", lambda dtype, device: mlp_config(bf16, gpu))
        skinny_config, skinny_splits = skinny.skinny_config, skinny.num_splits
        self._set(skinny, "skinny_config", lambda dtype, device: skinny_config(bf16, gpu))
        self._set(skinny, "num_splits", lambda n, k, cfg, device: skinny_splits(n, k, cfg, gpu))
        self._set(
            ta,
            "extend_config",
            lambda dtype, d, device, n=None, group=1: extend_config(bf16, d, gpu, n, group),
        )
        self._set(spa, "prefix_config", lambda dtype, device, *rows: prefix_config(bf16, gpu, *rows))

    def __exit__(self, *exc) -> None:
        for owner, name, value in reversed(self._restore):
            if isinstance(owner, dict):
                owner[name] = value
            else:
                setattr(owner, name, value)
        self._restore.clear()


def install_from_env() -> KernelVariants | None:
    """In a child process (through the sitecustomize that child_env writes): record to the file KERNEL_VARIANTS_LOG,
    with the options in KERNEL_VARIANTS_OPTIONS (JSON)."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return None
    return KernelVariants(log_path=path, **json.loads(os.environ.get(OPTIONS_ENV, "{}"))).__enter__()


def child_env(log_path: str, site: str, **options) -> dict[str, str]:
    """Environment for processes that should record into log_path: a sitecustomize (written into the directory site)
    that installs the recorder."""
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write("import bench.kernel_variant_keys\nbench.kernel_variant_keys.install_from_env()\n")
    return {
        "PYTHONPATH": os.pathsep.join([site, REPO, os.environ.get("PYTHONPATH", "")]),
        LOG_ENV: log_path,
        OPTIONS_ENV: json.dumps(options),
    }


def read_log(path: str) -> list[dict]:
    """The entries a child process appended: {"key": ..., "compile_seconds": ... or None}."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
