"""Model summary without training: ``python -m cem_jax.inspect --config=experiments/tiny.py``
(or ``python -m cem_jax.summary``; ``cem_jax/inspect.py`` is a shim kept for that command).

Prints every parameter (path, shape, count, logical axes, sharding on the configured mesh),
the totals (all, non-embedding, attention, MLP), the analytic FLOPs per token and, for a CEM
block, each energy and how its update is computed. It runs the start-up checks first
(:func:`cem_jax.preflight.check`: a user energy's causality, finiteness and closed form), so
it is the quick way to check an energy without training. The model
is built abstractly (``nnx.eval_shape``): nothing is allocated, so a 125M config inspects in
seconds on a laptop. ``--vocab_size`` stands in for the tokenizer's size (default:
``data.vocab_size``); ``--num_devices=N`` lays the mesh out for N devices (an abstract mesh:
a pod's sharding can be read on a laptop), checked as ``main`` would check it on N devices.
``--workdir=DIR`` inspects a trained run's model, from its ``config.json``, instead of
``--config``, and ends with where its parameters started from if another run's checkpoint
(``checkpoint.load_parameters_from``: :func:`parameters_from_line`).
"""

from __future__ import annotations

import ml_collections
from absl import app, flags, logging

from cem_jax import cli
from cem_jax import config as config_lib

# jax, flax and the model code are imported where they are used: a bad flag or config file is
# refused in a fraction of a second, not after jax's start-up.


def summary(config, vocab_size: int | None = None, devices=None,
            num_devices: int | None = None) -> dict:
  """Returns ``{'rows': [...], 'totals': {...}, 'flops_per_token': {...}, 'mesh': shape,
  'num_layers': L, 'unique_blocks': G, 'energies': [...]}`` (G < L: shared depth, layer l
  runs block l % G; ``energies``: :func:`_energies`).
  ``flops_per_token``: ``forward`` (analytic, :mod:`cem_jax.model_stats`) and ``train``
  (3× forward) FLOPs per token.

  Each row: ``path``, ``shape``, ``count``, ``logical_axes``, ``spec`` (the PartitionSpec on
  the configured mesh, as a string).

  ``devices``: the devices of the mesh (default: all of this process's view); or
  ``num_devices``: their number only, for an abstract mesh (``jax.sharding.AbstractMesh``).

  Raises:
    ValueError: an invalid config, ``num_devices`` < 1, or a mesh that does not fit the
      devices.
  """
  import jax
  from flax import nnx

  from cem_jax import axes, model_stats, preflight, sharding
  from cem_jax.model import abstract_model, known_flops_per_token

  preflight.check(config)
  vocab = config_lib.vocab_size(config, vocab_size)
  if num_devices is not None:
    config_lib.check_count("--num_devices", num_devices)
  if num_devices is None:
    devices = jax.devices() if devices is None else devices
  count = len(devices) if num_devices is None else num_devices
  axes.check_config(config, count)  # the layout main.py would accept, or its error
  if num_devices is None:
    mesh = sharding.make_mesh(config.mesh, devices)
  else:  # param_specs reads the axis sizes only: no device is needed
    mesh = jax.sharding.AbstractMesh(axes.mesh_shape(config.mesh, count), axes.MESH_AXES)
  model_config = config.model
  if num_devices is not None and model_config.attention_impl in ("cudnn", "splash"):
    # Whether the kernel runs is the N devices' machine's to say (main's check_machine there;
    # preflight.check refused what no machine runs): the parameters do not depend on it.
    model_config = ml_collections.ConfigDict(model_config.to_dict())
    model_config.attention_impl = "xla"
  model = abstract_model(model_config, vocab)
  state = nnx.state(model, nnx.Param)
  specs = sharding.param_specs(state, axes.rules_from_config(config.mesh), mesh)
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  spec_by_path = {jax.tree_util.keystr(p): s
                  for p, s in jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec)}
  rows = []
  for path, var in jax.tree_util.tree_leaves_with_path(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    key = jax.tree_util.keystr(path)
    rows.append({"path": key, "shape": tuple(var.shape), "count": int(var.size),
                 "logical_axes": var.get_metadata().get("logical_axes"),
                 "spec": str(spec_by_path.get(key, ""))})
  counts = model_stats.parameter_counts(model)
  totals = {"params": counts["params"], "non_embedding": counts["non_embedding_params"],
            "attention": counts["attention_params"], "mlp": counts["mlp_params"]}
  forward = known_flops_per_token(config.model, vocab, config.data.seq_len)
  return {"rows": rows, "totals": totals, "mesh": dict(mesh.shape),
          "num_layers": config.model.num_layers, "unique_blocks": len(model.blocks),
          "flops_per_token": {"forward": forward,
                              "train": None if forward is None else 3 * forward},
          "energies": _energies(config.model)}


def _energies(m) -> list[dict]:
  """The CEM slots' energies (``field``, ``name``, ``update``: 'closed form' or 'jax.grad',
  ``builtin``), as the model resolves them; [] for a Llama block."""
  from cem_jax import energies, updates

  if m.block != "cem":
    return []
  out = []
  for kind, used in (("attention", m.cem_attention), ("mlp", m.cem_mlp)):
    if used:
      spec = energies.get(m[f"{kind}_energy"], kind, f"model.{kind}_energy")
      fused = updates.resolve_update(spec, m.update_mode) is spec.fused_update
      out.append({"field": f"model.{kind}_energy", "name": spec.name, "builtin": spec.builtin,
                  "update": "closed form" if fused else "jax.grad"})
  return out


def format_summary(s: dict) -> str:
  """The text table ``python -m cem_jax.inspect`` prints for a :func:`summary`."""
  width = max(len(r["path"]) for r in s["rows"])
  lines = [f"{'parameter':<{width}}  {'shape':<18} {'count':>10}  logical axes -> sharding"]
  for r in s["rows"]:
    lines.append(f"{r['path']:<{width}}  {str(r['shape']):<18} {r['count']:>10,}  "
                 f"{r['logical_axes']} -> {r['spec']}")
  t = s["totals"]
  lines += [
      "",
      f"mesh: {s['mesh']}",
      f"blocks: {s['unique_blocks']} unique, {s['num_layers']} layers"
      + (f" (layer l runs block l % {s['unique_blocks']})"
         if s["unique_blocks"] < s["num_layers"] else ""),
      f"parameters: {t['params']:,} total, {t['non_embedding']:,} non-embedding, "
      f"{t['attention']:,} attention, {t['mlp']:,} MLP",
      "FLOPs per token: n/a (a user energy's own operations are not modelled)"
      if s["flops_per_token"]["forward"] is None else
      f"FLOPs per token: {s['flops_per_token']['forward'] / 1e6:.2f} M forward, "
      f"{s['flops_per_token']['train'] / 1e6:.2f} M per training token",
  ]
  if not s["energies"]:
    lines.append("energies: none (no CEM sub-layer)")
  for e in s["energies"]:
    checked = ("built-in, verified by tests/test_energies.py" if e["builtin"] else
               "a user energy: the start-up checks passed")
    lines.append(f"{e['field']}={e['name']!r}: update by {e['update']} ({checked})")
  return "\n".join(lines)


def check_energies_unedited(workdir: str, config: ml_collections.ConfigDict):
  """Refuses to describe the run in ``workdir`` as ``config`` when a user energy was edited
  since its newest intact checkpoint was saved (its function or closed form, or a constant or
  helper they read: :func:`cem_jax.runs.refuse_edited_energies`), as ``sample`` and
  ``evaluate`` refuse to load it. Nothing is checked without a checkpoint.

  Returns:
    That checkpoint's metadata (:class:`cem_jax.runs.CheckpointMeta`; without a checkpoint,
    one with no field set).

  Raises:
    ValueError: one line naming the checkpoint and the energies.
    CheckpointError: checkpoints exist but none is intact.
  """
  from cem_jax import runs

  checkpoint, meta = runs.newest_meta(workdir)
  if checkpoint is not None:
    runs.refuse_edited_energies(meta, config, checkpoint, "the summary would describe a model "
                                "never trained; restore the energy it was trained with")
  return meta


def parameters_from_line(meta) -> str | None:
  """The line ``inspect --workdir`` prints for a run whose parameters started from another
  run's checkpoint (``checkpoint.load_parameters_from``; ``meta``: a
  :class:`cem_jax.runs.CheckpointMeta`), e.g. ``parameters from: /runs/base/checkpoints/1000
  (step 1000, digest sha256 3f2a...)``; None for a run initialised from its seed."""
  source = meta.parameters_from
  if not source:
    return None
  digest = source.get("digest_sha256")
  return (f"parameters from: {source.get('checkpoint')} (step {source.get('step')}"
          + (f", digest sha256 {digest[:16]}" if digest else "") + ")")


def main(argv):
  cli.no_extra_args(argv)
  fl = flags.FLAGS
  # The table is the output: --workdir reads the run's checkpoint metadata, and Orbax logs its
  # read-only manager (27 lines); our own warnings still show.
  cli.quiet_libraries(logging.logging.ERROR)  # a Python logging level
  with cli.user_errors():
    if fl.vocab_size is not None:  # before a run's checkpoint is read
      config_lib.check_flag("--vocab_size", "data.vocab_size", fl.vocab_size)
    if fl.num_devices is not None:
      config_lib.check_count("--num_devices", fl.num_devices)
    cli.check_folder("workdir", fl.workdir, "a trained run's folder")
    if (fl.config is None) == (fl.workdir is None):
      raise ValueError("give one of --config=FILE.py (a config to inspect) or --workdir=DIR (a "
                       "trained run's config.json)")
    started = None  # where a trained run's parameters started from, if not its seed
    if fl.workdir is None:
      config = cli.load_config()
    else:
      from cem_jax import runs

      config = runs.run_config(fl.workdir)
      started = parameters_from_line(check_energies_unedited(fl.workdir, config))
    text = format_summary(summary(config, fl.vocab_size, num_devices=fl.num_devices))
    print(text if started is None else f"{text}\n{started}")


def run() -> None:
  """The command line: defines the flags and runs :func:`main`."""
  cli.define_config_flag()
  flags.DEFINE_string("workdir", None, "A trained run's folder: inspect the config in its "
                      "config.json instead of --config.")
  flags.DEFINE_integer("vocab_size", None, "Vocabulary size (default: data.vocab_size).")
  flags.DEFINE_integer("num_devices", None, "Lay the mesh out for this many devices (default: "
                       "this machine's), e.g. a TPU pod's, without them.")
  app.run(main, flags_parser=cli.parse_flags)


if __name__ == "__main__":
  run()
