"""Studies: the paper's experiments as run configs, paired comparisons, sweeps, tables and figures.

Built on the training harness (:mod:`equiopt.train`), never imported by it.
"""
