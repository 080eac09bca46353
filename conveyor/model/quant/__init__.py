"""Quantized weights served quantized: block formats, their CPU kernels and the modules that
replace the float projections (same call interface as layers.Linear / MergedLinear).

Formats (a weight (N, K) in blocks of 32 input elements, one fp16 scale per block):
    q4  4-bit unsigned q, value = q * d + m           (GGUF Q4_1 as is; Q4_0 with m = -8 d;
                                                      Q4_K with d = d_K * sc, m = -dmin_K * mn)
    q8  int8 q,          value = q * d                 (GGUF Q8_0 as is; MXFP4 as is: q its
                                                      doubled e2m1 value, d its halved power of
                                                      two; any other GGUF type and
                                                      `--quantization int8` requantize to it)
Activations are quantized per token and block to int8 inside the kernel (as llama.cpp's
Q8_0/Q8_1 dot products do), so a block's dot product is an integer dot product.

By default (batch-invariant, CPU) every row count runs one kernel instead of the routes below:
kernels/gemm/panel_gemm.cpp, int8 activations per block of 32 as here (VNNI on AVX-512, maddubs on
AVX2), float activations for the lm_head, each output value one chain in a fixed order; the
blocks are packed into column panels at load (QuantLinear.pack_panels). On a CPU with
AMX-BF16 the prompt tokens take bfloat16 tiles of the same weights instead (model/prompt_route.py),
generated tokens these blocks. What follows is what `--no-batch-invariant` runs.

Kernel choice. `python -m benchmarks quant-kernels` prints ms per call of each candidate for
SmolLM2-135M's shapes, one thread, cycling through 30 weights so that they stream from memory
as in a real step. On this project's shared 2-core Xeon (AVX-512 VNNI/AMX capable; the
kernels here use AVX2+FMA+F16C only, for Zen 3 and older CPUs):

    shape (N x K)     T    f32   fbgemm_i8  i8pack_mm  i4pack_mm  q4_block  q8_block  q4_tiles
    qkv 960x576       1   0.128    0.038      0.380      0.839     0.026     0.042     0.108
                      8   0.336    0.073      2.398      6.515     0.165     0.139     0.148
                     32   0.379    0.106        -          -       0.615     0.565     0.341
                    512   3.076    1.168        -          -       9.588     7.948     3.485
    gate_up 3072x576  1   0.515    0.130      1.205      2.717     0.133     0.213     0.403
                      8   1.023    0.229      7.617     20.734     0.656     0.496     0.507
                     32   1.300    0.383        -          -       1.936     1.568     1.031
                    512   9.033    3.434        -          -      30.335    25.101    10.324
    down 576x1536     1   0.216    0.057      0.599      1.342     0.047     0.081     0.241
                      8   0.392    0.111      3.726     10.393     0.239     0.352     0.328
                     32   0.460    0.159        -          -       0.800     0.781     0.682
    o 576x576         1   0.059    0.026      0.200      0.505     0.016     0.022     0.079
                     32   0.176    0.069        -          -       0.366     0.354     0.207
    logits 49152x576  1   8.099    1.675     19.255     43.344     2.031     3.272     6.287
                      8  15.974    3.623    128.077    339.553    10.797     7.989     8.296
                     32  21.239    6.923        -          -      33.568    27.032    18.558
    (T = 64 in the printout: the same ordering as T = 32.)

`torch._weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` are far slower than float32 at
every T on this CPU. fbgemm's dynamic int8 linear (`quantized.linear_dynamic`) is the fastest
from 8 tokens up here (VNNI), but it rounds activations per tensor and would need its own
per-channel int8 copy of every weight; it is not used (yet). So: a small AVX2 extension
(kernels/gemm/quant_gemm.cpp) reads the GGUF-style blocks directly, with activations rounded to int8
per block of 32 (q4_block/q8_block: at T = 1 it streams weights at memory speed, 0.63 bytes
per parameter for q4 instead of 4); from DEQUANT_FROM_TOKENS tokens on, the step is
compute-bound and MKL wins: rows are dequantized in L2-sized tiles and multiplied there
(q4_tiles; no float copy of the whole weight is kept). The lm_head always takes float
activations: its logits pick the sampled token, and int8 activations flipped a 0.08-nat near
tie in the default model's greedy answer to "What is the capital of France?". Up to 16 rows it
runs a block kernel with float activations (each block widened once, then multiplied with every
row: 1.5 ms for the tied Q8_0 head at one row on Zen 3, against ~9 ms through float tiles),
and the tiles from there.

Whole model, one thread, ModelRunner decode steps (ctx 256), float32 vs the Q4_1 file served
quantized, side by side: batch 1: 48.3 -> 23.2 ms, batch 8: 113.5 -> 68.5 ms, batch 32:
175.5 -> 159.8 ms; a 512-token prefill 861 -> 934 ms. Weights 513 -> 92 MiB.

The package, one job a module (layers import downward: formats <- gguf_blocks, ops <- modules
<- load_plan): formats.py (BlockWeight, q4 / q8), gguf_blocks.py (GGUF tensors as blocks),
ops.py (the kernels' wrappers, the int8 route), modules.py (QuantLinear, QuantEmbedding),
load_plan.py (QuantPlan: which tensors load quantized where). Everything is importable from
`conveyor.model.quant` as before the split.
"""

from __future__ import annotations

from conveyor.model.families import projection_of
from conveyor.model.gguf_loader import GGUF_FLOAT_TYPES, is_quantized_gguf
from conveyor.model.quant.formats import FORMATS, QK, BlockWeight, quantize_q4, quantize_q8
from conveyor.model.quant.gguf_blocks import from_gguf_blocks
from conveyor.model.quant.load_plan import (
    QuantPlan,
    pack_int8_modules,
    plan_quantization,
)
from conveyor.model.quant.modules import (
    QuantConcatLinear,
    QuantEmbedding,
    QuantLinear,
    error_weights,
    merged_linear,
)
from conveyor.model.quant.ops import (
    DEQUANT_FROM_TOKENS,
    INT8_ENV,
    INT8_FROM_TOKENS,
    OUTLIER_RATIO,
    block_linear,
    dequantize,
    has_vnni,
    int8_gemm_available,
    int8_linear,
    int8_route_enabled,
    kernel_supported,
    kernels,
    kernels_available,
    pack_int8,
    reference_int8_linear,
    reference_linear,
    weight_columns,
)

__all__ = [
    "DEQUANT_FROM_TOKENS",
    "FORMATS",
    "GGUF_FLOAT_TYPES",
    "INT8_ENV",
    "INT8_FROM_TOKENS",
    "OUTLIER_RATIO",
    "QK",
    "BlockWeight",
    "QuantConcatLinear",
    "QuantEmbedding",
    "QuantLinear",
    "QuantPlan",
    "block_linear",
    "dequantize",
    "error_weights",
    "from_gguf_blocks",
    "has_vnni",
    "int8_gemm_available",
    "int8_linear",
    "int8_route_enabled",
    "is_quantized_gguf",
    "kernel_supported",
    "kernels",
    "kernels_available",
    "merged_linear",
    "pack_int8",
    "pack_int8_modules",
    "plan_quantization",
    "projection_of",
    "quantize_q4",
    "quantize_q8",
    "reference_int8_linear",
    "reference_linear",
    "weight_columns",
]
