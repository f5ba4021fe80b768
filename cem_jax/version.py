"""The numerics version: bumped whenever an unchanged config trains to different numbers.

``python -m cem_jax.tables`` reuses a finished run only when it was trained under the current
version (a run without one counts as version 1), and the golden test
(``tests/test_golden.py``) pins the numbers of this version: a deliberate numerics change bumps
this constant, says here what changed, and re-pins the golden numbers.

History:
  1: everything before the constant existed.
  2: the warm-up's first update uses ``peak / warmup_steps`` (it used 0, so every update came
     one schedule step late); the held-out split interleaves chunks of the text instead of
     taking its tail.
"""

NUMERICS_VERSION = 2
