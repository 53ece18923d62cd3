"""The modules users put in their models, and how they run.

``Linear`` (``linear``) and its custom ops (``linear_ops``, whose arguments are
the dataclasses of ``linear_args``); the ways to turn FP8 on (``autocast``,
``convert``); activation checkpointing (``checkpointing``) and the
tensor-parallel forward on DTensor shards (``tensor_parallel``). They ask the
recipe layer's quantizers how to quantize and never branch on the recipe.
"""
