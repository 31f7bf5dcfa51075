"""The projection kernels' checks of bench/check_kernels_gpu.py's Checker (a mixin: it brings torch, the device, the
twins and record()): the weight-streaming projection, gate/up with SiLU-and-mul, and the norms inside them. Apart
because they check one family, the kernels that stream a decode layer's weights (kernels/triton_skinny_linear.py,
kernels/triton_mlp.py), while the Checker's own methods check attention and the elementwise kernels. No torch import
here: the checker imports it after it has set TRITON_INTERPRET."""

from bench.paged_batch import rel_err

TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}


class ProjectionChecks:
    def gate_up(self, dtype, rows, hidden, inter, g, config=None):
        """kernels/triton_mlp.py against its twin (the projection, then SiLU-and-mul)."""
        from kernels import triton_mlp

        torch = self.torch
        dev_gen = torch.Generator(device=self.device)  # model-sized weights: drawn where they live
        dev_gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))
        x = (torch.randn(rows, hidden, generator=dev_gen, device=self.device) / hidden**0.25).to(dtype)
        w = (torch.randn(2 * inter, hidden, generator=dev_gen, device=self.device) / hidden**0.25).to(dtype)
        ref = self.ref.silu_and_mul(torch.nn.functional.linear(x.float(), w.float()))
        out = triton_mlp.gate_up_silu(x, w, config)
        self.record(
            "gate_up_silu",
            dtype,
            f"M{rows} H{hidden} I{inter}",
            "vs fp32 projection + silu_and_mul",
            rel_err(torch, out, ref),
            TOLERANCE[str(dtype).replace("torch.", "")],
        )

    def skinny(self, dtype, rows, n, k, g, splits=None):
        """kernels/triton_skinny_linear.py against an fp32 projection; twice, to show the split counters reset."""
        from kernels import triton_skinny_linear

        torch = self.torch
        dev_gen = torch.Generator(device=self.device)
        dev_gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))
        x = (torch.randn(rows, k, generator=dev_gen, device=self.device) / k**0.25).to(dtype)
        w = (torch.randn(n, k, generator=dev_gen, device=self.device) / k**0.25).to(dtype)
        ref = torch.nn.functional.linear(x.float(), w.float())
        first = triton_skinny_linear.skinny_linear(x, w, splits=splits)
        second = triton_skinny_linear.skinny_linear(x, w, splits=splits)
        err = rel_err(torch, first, ref) if torch.equal(first, second) else float("inf")  # deterministic, reset
        self.record(
            "skinny_linear",
            dtype,
            f"M{rows} N{n} K{k}",
            f"splits {splits or 'auto'} vs fp32 projection",
            err,
            TOLERANCE[str(dtype).replace("torch.", "")],
        )

    def norm_in_projections(self, dtype, rows, k_o, hidden, n_qkv, inter, g, splits=None):
        """A decode layer's norms inside its projections (kernels.fuses_norms): an output projection that adds the
        residual and writes its rows' sums of squares, then a QKV and a gate/up projection that take the norm from
        them, each against fp32 (the consumers from the producer's own output, so each is measured alone)."""
        from kernels import triton_mlp, triton_skinny_linear

        torch = self.torch
        dev_gen = torch.Generator(device=self.device)
        dev_gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))
        draw = lambda *shape: torch.randn(*shape, generator=dev_gen, device=self.device)  # noqa: E731
        x, res = (draw(rows, k_o) / k_o**0.25).to(dtype), draw(rows, hidden).to(dtype)
        w_o, w_qkv = (draw(hidden, k_o) / k_o**0.25).to(dtype), (draw(n_qkv, hidden) / hidden**0.25).to(dtype)
        w_gu = (draw(2 * inter, hidden) / hidden**0.25).to(dtype)
        h, squares = triton_skinny_linear.skinny_linear(x, w_o, splits=splits, residual=res)
        h_ref = torch.nn.functional.linear(x.float(), w_o.float()) + res.float()
        shape, tol = f"M{rows} H{hidden} K{k_o}", TOLERANCE[str(dtype).replace("torch.", "")]
        self.record(
            "norm_in_projections",
            dtype,
            shape,
            f"residual add, splits {splits or 'auto'}",
            rel_err(torch, h, h_ref),
            tol,
        )
        sums = squares.sum(-1)
        self.record(
            "norm_in_projections",
            dtype,
            shape,
            "its rows' sums of squares",
            rel_err(torch, sums, h.float().pow(2).sum(-1)),
            tol,
        )
        eps = 1e-6
        normed = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + eps)
        qkv = triton_skinny_linear.skinny_linear(h, w_qkv, squares=squares, eps=eps)
        qkv_ref = torch.nn.functional.linear(normed, w_qkv.float())
        self.record(
            "norm_in_projections",
            dtype,
            f"M{rows} N{n_qkv} K{hidden}",
            "QKV of rmsnorm(h)",
            rel_err(torch, qkv, qkv_ref),
            tol,
        )
        gu = triton_mlp.gate_up_silu(h, w_gu, squares=squares, eps=eps)
        gu_ref = self.ref.silu_and_mul(torch.nn.functional.linear(normed, w_gu.float()))
        self.record(
            "norm_in_projections",
            dtype,
            f"M{rows} H{hidden} I{inter}",
            "gate/up of rmsnorm(h)",
            rel_err(torch, gu, gu_ref),
            tol,
        )
