"""Scaled FP8 matrix multiplies: the float64 references, torch's ``scaled_mm`` and FP8 linear layers.

==================  ==========================================================================
``reference``       THE float64 references for scaled matmuls (FP8 blockwise 1x128 x 128x128,
                    per-tensor / row-wise) and the derived error bound that every GEMM test,
                    the lesson and ``benchmarks/bench_fp8_gemm.py`` compare against
``emulation``       the FP8 GEMMs computed in fp32 (exact products, fp32 sums): the CPU path
``gemm_rules``      the FP8 tensor-core GEMM's rules (layouts, multiples of 16, alignment, scales),
                    checked on every backend before any GEMM runs
``scaled_mm``       torch's ``scaled_mm`` with the repository's quantized buffers
``fp8_linear``      ``nn.Linear`` computed with FP8 GEMMs
``fp8_recipe``      the FP8 linear's recipe and token rules (``pad_tokens``: exact zero padding)
==================  ==========================================================================

The Triton kernel itself is ``tutorial_kernels.fp8_gemm.blockwise_fp8_gemm`` (kernels are a leaf:
they import nothing from here). Layer: ``tutorial_lib.matmul`` sits between ``models`` and ``quant``
-- it may import ``tutorial_lib.quant``, ``tutorial_lib.harness`` and ``tutorial_kernels``.

Example::

    from tutorial_lib.quant.blockwise import quantize_fp8_blockwise
    from tutorial_lib.matmul.reference import blockwise_fp8_gemm_reference
    x, w = torch.randn(64, 256), torch.randn(128, 256)
    a, sa = quantize_fp8_blockwise(x, (1, 128))           # activations [M, K]
    b, sb = quantize_fp8_blockwise(w, (128, 128))         # weight [N, K], like nn.Linear
    y = blockwise_fp8_gemm_reference(a, sa, b, sb)        # fp32 [M, N], computed in float64
"""
