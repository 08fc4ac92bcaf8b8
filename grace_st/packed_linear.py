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

A PEFT LoRA layer (training's policy, or a model loaded with ``merge_adapter=False``) is packed
merged: W + Σ ΔW of its active adapters (PEFT's ``get_delta_weight``), repacked whenever the
adapter or the base weight changes, so the layer costs one product instead of three (the
adapter's two skinny products were 10–15 % of a training step's rollouts, docs/scale.md). That
is the weight ``merge_and_unload`` gives, the one ``encode`` uses for a saved adapter; results
differ from PEFT's own forward by float32 rounding. Adapters PEFT would not merge the same way
(DoRA and other variants, a bias on B, dropout in training mode) keep PEFT's forward.

``packed_linears(model, enabled=False)`` does nothing; rollouts pass
``DecodeOptions.packed_linears`` and ``DecodeOptions.merge_adapters`` (:mod:`grace_st.decoding`) there.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .weights import tensor_change_key

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


def native_bfloat16() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (AVX-512 BF16, AMX). Without them (an AVX2
    CPU) a bfloat16 matmul is emulated: 6x slower than float32 at 512 rows on one thread."""
    bf16_supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bf16_supported is not None and bool(bf16_supported())


def packed_dtypes() -> tuple[torch.dtype, ...]:
    """float32 always; bfloat16 where oneDNN has bfloat16 kernels for this CPU."""
    return (torch.float32, torch.bfloat16) if native_bfloat16() else (torch.float32,)


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


def _lora_layer_class():
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # without PEFT installed there is no LoRA layer to merge
        return None
    return Linear


def _active_lora(module: nn.Module, dtypes: tuple[torch.dtype, ...], lora_class: type | None) -> list[str] | None:
    """The adapters to merge into a PEFT LoRA linear layer's packed weight, or None where the
    merged product would not equal PEFT's forward (or there is nothing to merge)."""
    if lora_class is None or not isinstance(module, lora_class) or "forward" in module.__dict__:
        return None
    base = module.base_layer
    if not _packable(base, dtypes) or module.merged or module.disable_adapters or module.fan_in_fan_out:
        return None
    active = [name for name in module.active_adapters if name in module.lora_A]
    for name in active:
        dropout = module.lora_dropout[name]
        if (
            name in module.lora_variant
            or module.lora_bias.get(name, False)
            or module.lora_A[name].weight.dtype != base.weight.dtype
            or not (isinstance(dropout, nn.Identity) or not dropout.training)
        ):
            return None
    return active or None


def _packed_merged_weight(module: nn.Module, adapters: list[str]) -> Tensor:
    parts = [module.base_layer.weight] + [p.weight for name in adapters for p in (module.lora_A[name], module.lora_B[name])]
    key = (tuple(tensor_change_key(part) for part in parts), tuple(float(module.scaling[name]) for name in adapters))
    cached = _packed.get(module)
    if cached is None or cached[0] != key:
        merged = module.base_layer.weight.detach().clone()
        for name in adapters:
            merged += module.get_delta_weight(name).detach()
        cached = (key, torch.ops.mkldnn._reorder_linear_weight(merged))
        _packed[module] = cached
        _packed.pop(module.base_layer, None)  # the base alone is not run inside a block any more
    return cached[1]


def _merged_lora_forward(module: nn.Module, packed: Tensor, input: Tensor, *args, **kwargs) -> Tensor:
    # Anything PEFT would do differently (adapters switched off or merged inside the block, a
    # per-row adapter_names) and anything the packed kernel does not take (autograd, another
    # dtype or device) goes back to PEFT's own forward.
    base = module.base_layer
    if (
        args or kwargs or module.merged or module.disable_adapters or torch.is_grad_enabled()
        or input.dtype != base.weight.dtype or input.device.type != "cpu"
    ):
        return type(module).forward(module, input, *args, **kwargs)
    return torch.ops.mkldnn._linear_pointwise(input.contiguous(), packed, base.bias, "none", [], "")


def _packable(module: nn.Module, dtypes: tuple[torch.dtype, ...]) -> bool:
    return (
        type(module) is nn.Linear
        and module.weight.dtype in dtypes
        and module.weight.device.type == "cpu"
        and (module.bias is None or module.bias.dtype == module.weight.dtype)
        and "forward" not in module.__dict__  # already swapped by an enclosing block, or patched by someone else
    )


@contextlib.contextmanager
def packed_linears(model: nn.Module, enabled: bool = True, merge_adapters: bool = True) -> Iterator[None]:
    """Run ``model``'s CPU float32 (and bfloat16) linear layers on oneDNN-packed weights inside the block.

    Does nothing unless ``enabled``, while autograd is on, on other devices and dtypes, or when
    :func:`packing_enabled` says no. Weights are packed on first use and reused until they change.
    ``merge_adapters``: PEFT LoRA layers run on their merged weight (module docstring); off,
    only their base and adapter products are packed, each on its own.
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
    swapped, dtypes, inside_merged = [], packed_dtypes(), set()
    lora_class = _lora_layer_class() if merge_adapters else None  # once a block, not once a module
    try:
        for module in model.modules():
            adapters = _active_lora(module, dtypes, lora_class)
            if adapters:
                packed = _packed_merged_weight(module, adapters)
                module.forward = lambda input, *args, module=module, packed=packed, **kwargs: _merged_lora_forward(
                    module, packed, input, *args, **kwargs
                )
                swapped.append(module)
                inside_merged.update(id(child) for child in module.modules() if child is not module)
            elif id(module) not in inside_merged and _packable(module, dtypes):
                packed = _packed_weight(module)
                module.forward = lambda input, module=module, packed=packed: _packed_forward(module, packed, input)
                swapped.append(module)
        yield
    finally:
        for module in swapped:
            del module.forward


def matmul_peak_flops(dtype: torch.dtype, size: int = 2048, trials: int = 4, seconds: float = 0.25) -> tuple[float, str]:
    """This machine's matmul peak in ``dtype``: the best of several timed runs of a large square
    product with each kernel the encoder may use (MKL through ``torch.mm``; oneDNN with a packed
    weight, see grace_st.packed_linear). Early runs read low (thread start-up, clock ramp) and a
    low peak would flatter every floor fraction; the best kernel sets the bar. The benchmarks' floor
    (``benchmarks/encode_throughput.py``, ``decode_ablation.py``); returns (FLOP/s, kernel name)."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    kernels = {"mkl": lambda: torch.mm(a, b)}
    bf16_kernels = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()
    if hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_kernels)
    ):
        packed = torch.ops.mkldnn._reorder_linear_weight(b)
        kernels["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    best = (0.0, "")
    for _ in range(trials):
        for name, kernel in kernels.items():
            kernel()
            runs, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                kernel()
                runs += 1
            best = max(best, (2 * size**3 * runs / (time.perf_counter() - start), name))
    return best
