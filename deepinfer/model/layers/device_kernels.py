"""Send a model's shared layers to the Triton kernels when the engine runs on the Triton backend.

RMSNorm (with its fused residual add) and rotary embeddings carry an `on_triton` switch; the
runner flips it once, at construction, when the attention backend it built is Triton's, so on a
GPU the whole layer stack runs on device kernels and on the CPU the same switch proves them under
Triton's interpreter. Layers a family defines for itself keep their own code.
"""

from __future__ import annotations

import torch

from deepinfer.model.layers.norm import RMSNorm
from deepinfer.model.layers.rotary import RotaryEmbedding


def use_triton_kernels(model: torch.nn.Module) -> int:
    """Mutates every RMSNorm and RotaryEmbedding of `model` to run through kernels/triton;
    returns how many modules it switched."""
    switched = 0
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding)):
            module.on_triton = True
            switched += 1
    return switched
