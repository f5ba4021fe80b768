"""``python -m cem_jax.inspect``: the command of :mod:`cem_jax.summary` under its old name."""

from cem_jax.summary import format_summary, run, summary  # noqa: F401

if __name__ == "__main__":
  run()
