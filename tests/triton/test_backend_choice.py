"""Which attention backend the engine builds: `triton` when asked, and `auto` on CUDA."""

from __future__ import annotations

import torch

from deepinfer.runner.model_runner import make_attention_backend


class _Model:
    """What make_attention_backend reads of a model."""

    uses_attention_backend = True
    rounds_activations = False

    def attention_shape(self) -> tuple[int, int, int]:
        return 4, 2, 32


def test_auto_picks_triton_on_cuda():
    # A CUDA device object needs no GPU; the backend touches none until a step runs.
    assert make_attention_backend("auto", _Model(), 16, torch.device("cuda")).name == "triton"


def test_triton_when_asked(device):
    # on the CPU under the interpreter (this directory's conftest sets it)
    assert make_attention_backend("triton", _Model(), 16, torch.device(device)).name == "triton"
    assert make_attention_backend("torch", _Model(), 16, torch.device(device)).name == "torch"


def test_models_with_their_own_attention_learn_the_kernel_family(device):
    """DeepSeek-V4 attends through its own cache reader: the backend only names its kernels."""

    class _OwnAttentionModel(_Model):
        uses_attention_backend = False

    model = _OwnAttentionModel()
    assert make_attention_backend("triton", model, 16, torch.device(device)).name == "triton"
    assert make_attention_backend("auto", model, 16, torch.device("cuda")).name == "triton"
    assert make_attention_backend("auto", model, 16, torch.device("cpu")).name == "model"
