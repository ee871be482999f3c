"""The parts of the role symmetry checks; the entry point is
:func:`equiopt.roles.verify.verify_roles`, whose module docstring says what each check
moves and how it is judged.

Modules, by what each holds:

- ``report``: :class:`RoleCheck`, :class:`RoleReport` (and its text table), the check
  kinds and the default tolerances.
- ``forward``: running the model (the default forward call, the logits in its output)
  and the input it runs on.
- ``runner``: the common machinery: move weights, run, compare log-probabilities,
  restore bit for bit, record.
- ``moves``: how weights move along a symmetry (row permutations of work matrices,
  ``1 a^T`` shifts, a permutation of the leading expert axis).
- ``biases``: finding a weight's bias and moving it with the weight.
- ``paths``: parameter names as module paths (blocks, common prefixes).
- ``zeros``: filling all-zero parameters so that the checks can see them.
- ``neuron``, ``expert``, ``shift``, ``vocab``, ``conv``: one module per check kind.
"""
