"""Flax NNX layers: CEM sub-layers and block (:mod:`.cem`), the Llama baseline (:mod:`.llama`)."""

from cem_jax.layers.cem import CEMMLP, CEMAttention, CEMBlock, Preconditioner
from cem_jax.layers.common import DECAYED_PARAM_NAMES, DTYPES, BlockOut, RMSNorm
from cem_jax.layers.llama import LlamaAttention, LlamaBlock, SwiGLU

__all__ = [
    "BlockOut",
    "CEMAttention",
    "CEMBlock",
    "CEMMLP",
    "DECAYED_PARAM_NAMES",
    "DTYPES",
    "LlamaAttention",
    "LlamaBlock",
    "Preconditioner",
    "RMSNorm",
    "SwiGLU",
]
