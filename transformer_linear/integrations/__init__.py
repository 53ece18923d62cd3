"""Integrations with training engines, each an optional dependency imported only by its own module.

- :mod:`transformer_linear.integrations.torchtitan`: torchtitan model converters (``pip install
  "transformer_linear[torchtitan]"``). Importing this package imports no engine.
"""
