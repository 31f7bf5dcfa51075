"""The cases bench/check_kernels_gpu.py runs: the interpreter-sized set (run_small, what CI runs on the CPU under
TRITON_INTERPRET=1), the full GPU set (run_full: lengths up to 4,100 and a 32K decode, batch up to 256, every dtype,
GQA 1/2/4/8) and the layer-fusion kernels at model sizes (run_fused).

Apart from the checker because they are data (which shapes, lengths and dtypes each kernel is checked at) while the
checker is the method (inputs drawn, references computed, errors recorded): a case is added here without reading
how it is checked. Each function takes the Checker, torch, a generator and, for the elementwise kernels, their
module (bench/check_kernels_gpu.py imports torch only after it has set TRITON_INTERPRET)."""


def run_small(check, torch, g, ew):
    """Interpreter-sized: still prefix 0, extend 1, ragged lengths, GQA 1/2/4/8, several splits."""
    dtypes = [torch.float32, torch.float16]  # bf16 tl.dot is wrong in the Triton 3.9 CPU interpreter
    for dtype in dtypes:
        for hq, hkv, d in [(2, 2, 32), (4, 2, 64), (8, 2, 32), (8, 1, 16)]:
            check.extend(dtype, hq, hkv, d, [0, 37, 5, 70], [20, 1, 45, 3], "mixed: prefix 0, extend 1, ragged", g)
            check.decode(dtype, hq, hkv, d, [1, 83, 40, 17], "ragged lengths incl. 1", g, num_kv_splits=3)
    check.extend(torch.float32, 4, 1, 64, [0], [70], "one prefill, no prefix (3 row blocks)", g)
    check.extend(torch.float32, 4, 2, 32, [33, 0, 1, 2, 64], [1, 1, 1, 17, 32], "decodes in a mixed batch", g)
    check.extend(torch.float32, 6, 2, 32, [10, 0, 40], [25, 7, 11], "GQA group of 3: padding rows in each block", g)
    # Keys split across programs (a grid too small for the device): empty slices (prefix 0, a short prefix cut in
    # 3), the last slice's ragged tail, a decode row, a GQA group of 3.
    check.extend(torch.float32, 4, 2, 32, [50, 0, 3, 9], [9, 40, 1, 20], "keys split in 4", g, num_splits=4)
    check.extend(torch.float16, 6, 2, 32, [70, 0], [30, 17], "keys split in 3, GQA 3", g, num_splits=3)
    check.extend(torch.float32, 4, 1, 64, [0], [5], "split keys, all but the last slice empty", g, num_splits=8)
    check.extend(torch.float32, 4, 1, 32, [40], [3], "automatic split count (a lone hit's small grid)", g)
    check.decode(torch.float32, 4, 2, 32, [100, 3], "more splits than blocks", g, num_kv_splits=8)
    check.decode(torch.float32, 4, 2, 32, [300, 50, 1], "automatic split count", g)
    # A CUDA graph's grid, sized for a 40,960-token context: each context cut into its own live slices (decode_slicing:
    # at least the device-filling count, slices of ~256 tokens past that), the rest of the grid dead.
    check.decode(torch.float32, 2, 1, 32, [37], "graph's grid, one short context", g, max_seq_len=40960)
    check.decode(torch.float32, 2, 1, 32, [1030], "graph's grid, 1030 tokens", g, max_seq_len=40960)
    check.decode(torch.float32, 4, 2, 32, [700, 1, 9], "graph's grid, a batch of 3", g, max_seq_len=40960)
    for dtype in (torch.float32, torch.float16):  # the decode kernel doing the step's Q/K norms, RoPE and K/V store
        check.decode_prepared(
            dtype, 4, 2, 32, 32, True, [1, 83, 40, 17], "ragged incl. 1, 3 splits", g, num_kv_splits=3
        )
        check.decode_prepared(dtype, 8, 2, 32, 16, False, [700, 2, 9], "graph's grid", g, max_seq_len=40960)
    for index_dtype in (torch.int32, torch.int64):
        check.store_kv(torch.float32, 13, 2, 32, g, index_dtype)
    check.store_kv(torch.float16, 5, 4, 64, g, torch.int32)
    for write_table in (False, True):
        check.step_inputs(300, 40, g, write_table)  # three programs, the last one partly masked
    for dtype in (torch.float32, torch.float16):
        check.elementwise(dtype, 7, 96, 4, 2, 32, 32, 80, g, ew)
        check.elementwise(dtype, 3, 64, 2, 1, 64, 32, 33, g, ew)
        check.qkv_prep(dtype, 5, 4, 2, 32, 32, True, g)
        check.gate_up(dtype, 5, 64, 48, g)
    check.qkv_prep(torch.float32, 3, 6, 2, 64, 32, True, g)  # partial rotary: the rest is normalised, not rotated
    check.qkv_prep(torch.float32, 4, 4, 4, 32, 32, False, g)  # Llama: no norms
    check.gate_up(torch.float32, 19, 72, 40, g)  # ragged: rows over a tile, hidden and inter off the blocks
    for dtype in (torch.float32, torch.float16):
        check.skinny(dtype, 1, 40, 128, g, splits=1)  # K in whole BLOCK_K steps of the GPU's 16-bit tile (128)
        check.skinny(dtype, 16, 33, 256, g, splits=2)  # ragged columns, every row of the tile
    check.skinny(torch.float32, 5, 64, 256, g)  # the split count the kernel picks
    for dtype in (torch.float32, torch.float16):  # 640 wide: 20 or 40 producer column blocks, not a power of two
        check.norm_in_projections(dtype, 3, 128, 640, 48, 40, g, splits=1)
        check.norm_in_projections(dtype, 16, 256, 640, 48, 40, g, splits=2)  # split-K: the last program's epilogue


def run_full(check, torch, g, ew):
    import random

    rnd = random.Random(1234)
    heads = [(32, 32), (32, 16), (32, 8), (32, 4)]  # GQA 1, 2, 4, 8
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for d in (64, 128):
            for hq, hkv in heads:
                full = dtype == torch.bfloat16 or (hq, hkv) == (32, 8)
                check.extend(dtype, hq, hkv, d, [0], [4100], "prefill 4100, prefix 0", g)
                check.extend(dtype, hq, hkv, d, [4000, 0, 1, 2049], [100, 1, 333, 1], "prefix 4000 + mixed decodes", g)
                check.extend(dtype, hq, hkv, d, [1024], [128], "a lone hit: 1,024 cached + 128 (keys split)", g)
                check.extend(dtype, hq, hkv, d, [3000, 0], [20, 7], "keys split in 8", g, num_splits=8)
                check.decode(dtype, hq, hkv, d, [4100], "1 x 4100", g)
                check.decode(dtype, hq, hkv, d, [rnd.randint(1, 4100) for _ in range(7)] + [1], "8 random <=4100", g)
                if not full:
                    continue
                b = 64
                prefixes = [rnd.choice([0, rnd.randint(1, 700)]) for _ in range(b)]
                extends = [rnd.choice([1, rnd.randint(1, 300)]) for _ in range(b)]
                check.extend(dtype, hq, hkv, d, prefixes, extends, "64 random mixed", g)
                check.extend(
                    dtype,
                    hq,
                    hkv,
                    d,
                    [rnd.randint(0, 100) for _ in range(256)],
                    [rnd.randint(1, 20) for _ in range(256)],
                    "256 small",
                    g,
                )
                check.decode(dtype, hq, hkv, d, [rnd.randint(1, 700) for _ in range(256)], "256 random <=700", g)
    check.decode(torch.bfloat16, 32, 8, 128, [32768], "1 x 32768", g)
    for n in (1, 1024, 1300, 4096, 16384):  # batch 1 under a decode graph's grid (40,960 tokens)
        check.decode(torch.bfloat16, 32, 8, 128, [n], f"1 x {n}, graph's grid", g, max_seq_len=40960)
        check.decode_prepared(
            torch.bfloat16, 32, 8, 128, 128, True, [n], f"1 x {n}, graph's grid", g, max_seq_len=40960
        )
    check.decode_prepared(torch.bfloat16, 16, 8, 128, 128, True, [4099, 5, 1000, 1], "a batch of 4", g)
    check.decode_prepared(torch.float16, 9, 3, 64, 64, False, [300, 77], "SmolLM2's heads, no norms", g)
    check.decode(torch.bfloat16, 32, 8, 128, [4099, 5, 1000], "forced splits", g, num_kv_splits=1)
    check.decode(torch.bfloat16, 32, 8, 128, [4099, 5, 1000], "forced splits", g, num_kv_splits=64)
    for index_dtype in (torch.int32, torch.int64):
        check.store_kv(torch.bfloat16, 4100, 8, 128, g, index_dtype)
    check.store_kv(torch.float32, 333, 2, 64, g, torch.int32)
    for n, write_table in ((1, True), (256, True), (1000, False)):
        check.step_inputs(n, 1024, g, write_table)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        check.elementwise(dtype, 4100, 4096, 32, 8, 128, 128, 12288, g, ew)
        check.elementwise(dtype, 333, 896, 14, 2, 64, 32, 4864, g, ew)
        check.elementwise(dtype, 1, 5120, 40, 8, 128, 64, 13824, g, ew)
    run_fused(check, torch, g)


def run_fused(check, torch, g):
    """The kernels that cut a decode layer's launches, at model sizes (Qwen3-8B and -0.6B shapes)."""
    # fp16 is checked in the interpreter (tests/worker/test_kernels_triton.py)
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in (1, 77, 4100):
            check.qkv_prep(dtype, tokens, 32, 8, 128, 128, True, g)  # Qwen3-8B
        check.qkv_prep(dtype, 33, 16, 8, 128, 128, True, g)  # Qwen3-0.6B
        check.qkv_prep(dtype, 33, 14, 2, 64, 32, False, g)  # partial rotary, no norms
        for rows in (1, 16, 100):
            check.gate_up(dtype, rows, 4096, 12288, g)  # Qwen3-8B
            check.gate_up(dtype, rows, 1024, 3072, g)  # Qwen3-0.6B
        for rows in (1, 7, 16):
            for n, k in [(6144, 4096), (4096, 4096), (4096, 12288), (4096, 1024), (1024, 2048), (1024, 3072)]:
                check.skinny(dtype, rows, n, k, g)  # the projections of Qwen3-8B and -0.6B
            check.norm_in_projections(dtype, rows, 4096, 4096, 6144, 12288, g)  # Qwen3-8B
            check.norm_in_projections(dtype, rows, 2048, 1024, 4096, 3072, g)  # Qwen3-0.6B
