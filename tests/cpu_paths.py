"""The CPU instruction-set paths of this machine, for tests that force each one in turn."""

from __future__ import annotations

from transformer_linear import _C

# Every path the extension knows (set_cpu_isa names), most portable first.
ALL_ISAS = ("generic", "avx2", "avx512", "avx512_bf16")
SUPPORTED_ISAS = [isa for isa in ALL_ISAS if _C.cpu_isa_supported(isa)]
# The quantize kernels of avx512_bf16 are avx512's: one run covers both.
QUANTIZE_ISAS = [isa for isa in SUPPORTED_ISAS if isa != "avx512_bf16"]
