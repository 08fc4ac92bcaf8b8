"""oneDNN-packed weights for the float32 (and bfloat16) linear layers of CPU inference.

Generation decodes a batch one token at a time: every linear layer multiplies a few dozen rows
by its whole weight matrix. PyTorch's default CPU path (MKL ``sgemm``) runs those skinny
products at about half the machine's matmul peak; oneDNN with the weight reordered once into
its blocked layout runs them about twice as fast, in float32 and to float32 rounding
(``benchmarks/encode_throughput.py`` measures both). A bfloat16 model (``model_kwargs={"dtype":
torch.bfloat16}``) is packed too where oneDNN has bfloat16 kernels for this CPU.
:func:`packed_linears` swaps that kernel in for the duration of a no-grad block.

Costs and limits, all deliberate:
- a second copy of every packed weight stays in memory (the weights' size again), kept
  until the weight changes; it is repacked after any change (a training step, a
  ``load_state_dict``, a write through ``.data``), which is checked on every block entry;
- only CPU ``nn.Linear`` layers in float32 (or bfloat16, see above), and only while autograd is
  off: training's loss pass and any other dtype or device take PyTorch's own path;
- results differ from the MKL path by float32 rounding (relative 1e-6), as two BLAS libraries
  do; the same input still gives the same output;
- the first packing in a process is checked against ``F.linear``; a kernel that disagrees, or
  a PyTorch without the operator, switches packing off with a warning.

``packed_linears(model, enabled=False)`` does nothing; rollouts pass
``DecodeOptions.packed_linears`` (:mod:`grace_st.decoding`) there.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import tensor_change_key

# module -> (tensor_change_key of the weight it was packed from, packed weight).
# Kept beside the modules, not on them: packed tensors are not picklable and must not reach a state dict.
_packed: weakref.WeakKeyDictionary[nn.Linear, tuple[tuple, Tensor]] = weakref.WeakKeyDictionary()
_kernel_ok: bool | None = None  # None until the first packing in this process has been checked


def packing_enabled() -> bool:
    """Whether :func:`packed_linears` can pack anything here: a PyTorch with oneDNN's operators
    whose kernel passed its check (or was not checked yet)."""
    if _kernel_ok is False:
        return False
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _check_kernel() -> bool:
    """Compare the packed kernel with ``F.linear`` once, on odd shapes, before trusting it."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 29, generator=generator)
    bias = torch.randn(37, generator=generator)
    inputs = torch.randn(3, 5, 29, generator=generator)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        got = torch.ops.mkldnn._linear_pointwise(inputs, packed, bias, "none", [], "")
    except (RuntimeError, NotImplementedError) as error:
        warnings.warn(f"oneDNN packed linear layers are unavailable ({error}); using PyTorch's default path")
        return False
    if not torch.allclose(got, F.linear(inputs, weight, bias), rtol=1e-5, atol=1e-5):
        warnings.warn("oneDNN packed linear layers disagree with F.linear; using PyTorch's default path")
        return False
    if torch.bfloat16 in packed_dtypes():
        weight, bias, inputs = weight.bfloat16(), bias.bfloat16(), inputs.bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        got = torch.ops.mkldnn._linear_pointwise(inputs, packed, bias, "none", [], "").float()
        if not torch.allclose(got, F.linear(inputs, weight, bias).float(), rtol=2e-2, atol=5e-2):
            warnings.warn("oneDNN packed bfloat16 linear layers disagree with F.linear; using PyTorch's default path")
            return False
    return True


def packed_dtypes() -> tuple[torch.dtype, ...]:
    """float32 always; bfloat16 where oneDNN has bfloat16 kernels for this CPU (AVX-512 BF16, AMX)."""
    bf16_supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if bf16_supported is not None and bf16_supported():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


def _packed_weight(module: nn.Linear) -> Tensor:
    key = tensor_change_key(module.weight)
    cached = _packed.get(module)
    if cached is None or cached[0] != key:
        cached = (key, torch.ops.mkldnn._reorder_linear_weight(module.weight.detach()))
        _packed[module] = cached
    return cached[1]


def _packed_forward(module: nn.Linear, packed: Tensor, input: Tensor) -> Tensor:
    if input.dtype != module.weight.dtype or input.device.type != "cpu" or torch.is_grad_enabled():
        return F.linear(input, module.weight, module.bias)
    return torch.ops.mkldnn._linear_pointwise(input.contiguous(), packed, module.bias, "none", [], "")


def _packable(module: nn.Module, dtypes: tuple[torch.dtype, ...]) -> bool:
    return (
        type(module) is nn.Linear
        and module.weight.dtype in dtypes
        and module.weight.device.type == "cpu"
        and (module.bias is None or module.bias.dtype == module.weight.dtype)
        and "forward" not in module.__dict__  # already swapped by an enclosing block, or patched by someone else
    )


@contextlib.contextmanager
def packed_linears(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Run ``model``'s CPU float32 (and bfloat16) linear layers on oneDNN-packed weights inside the block.

    Does nothing unless ``enabled``, while autograd is on, on other devices and dtypes, or when
    :func:`packing_enabled` says no. Weights are packed on first use and reused until they change.
    """
    global _kernel_ok
    if not enabled or torch.is_grad_enabled() or not packing_enabled():
        yield
        return
    if _kernel_ok is None:
        _kernel_ok = _check_kernel()
        if not _kernel_ok:
            yield
            return
    swapped, dtypes = [], packed_dtypes()
    try:
        for module in model.modules():
            if _packable(module, dtypes):
                packed = _packed_weight(module)
                module.forward = lambda input, module=module, packed=packed: _packed_forward(module, packed, input)
                swapped.append(module)
        yield
    finally:
        for module in swapped:
            del module.forward
