"""``python -m cem_jax.inspect``: the command of :mod:`cem_jax.summary` under its old name."""

import runpy

if __name__ == "__main__":
  # Runs summary as the main module: absl's --help lists the main module's flags.
  runpy.run_module("cem_jax.summary", run_name="__main__", alter_sys=True)
