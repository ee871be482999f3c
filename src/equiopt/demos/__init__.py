"""Demonstrations behind ``equiopt demo``.

- :mod:`equiopt.demos.quick` (``equiopt demo --quick``): optimizer only, one minute, no data.
- :mod:`equiopt.demos.pretrain` (``equiopt demo``): trains two small Qwen3-style models on a
  corpus fetched from a package registry and compares them.
"""
