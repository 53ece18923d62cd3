"""The lowest layer: what every other layer agrees on about FP8 tensors.

The FP8 / E8M0 dtypes (``dtypes``), the GEMM operand scalings and their scale
layouts (``block_scaling``: scaled_mm's ScalingTypes, resolved once per GEMM),
the operand layouts the backends take (``layout``) and the argument checks
shared by the ops and the modules (``checks``). Nothing here imports another
part of the package.
"""
