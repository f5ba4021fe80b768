"""``python -m cem_jax.inspect``: the command of :mod:`cem_jax.summary` under its old name."""

import runpy

if __name__ == "inspect":
  # A cem_jax file run as a script (python cem_jax/main.py) puts cem_jax/ first on sys.path,
  # where this file hides Python's inspect from every library: say so, not a missing name.
  raise ImportError("cem_jax/inspect.py was imported as Python's inspect, because a cem_jax "
                    "file was run as a script (python cem_jax/main.py); run it as a module: "
                    "python -m cem_jax.main")

if __name__ == "__main__":
  # Runs summary as the main module: absl's --help lists the main module's flags.
  runpy.run_module("cem_jax.summary", run_name="__main__", alter_sys=True)
