"""oneDNN-packed weights for the float32 (and bfloat16) linear layers of CPU inference.

Generation decodes a batch one token at a time: every linear layer multiplies a few dozen rows
by its whole weight matrix. PyTorch's default CPU path (MKL ``sgemm``) runs those skinny
products at about half the machine's matmul peak; oneDNN with the weight reordered once into
its blocked layout runs them about twice as fast, in float32 and to float32 rounding
(``benchmarks/encode_throughput.py`` measures both). A bfloat16 model (``model_kwargs={"dtype":
torch.bfloat16}``) is packed too where oneDNN has bfloat16 kernels for this CPU.
:func:`packed_linears` runs that kernel for the duration of a no-grad block.

Threads: a block changes nothing shared while it runs. The first block that packs a layer gives it
a forward of its own for good (:class:`_PackedDispatch`, installed once under a lock, picklable),
which runs the packed product only where the *calling* thread's (or task's) block holds that layer:
the block's layouts live in a :class:`contextvars.ContextVar`, so two threads decoding with one
model at once each run what their own block asks, and a thread outside any block (a training
forward) runs the class's own forward. Packing and repacking the weights (the shared copies in
``_packed``) happen under the module's lock; the products themselves run unlocked.

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

A PEFT LoRA layer (training's policy) is packed merged: W + Σ ΔW of its active adapters (PEFT's
``get_delta_weight``), repacked whenever the adapter or the base weight changes, so the layer costs one
product instead of three (the adapter's two skinny products were 10–15 % of a training step's rollouts,
decisions/D008). That is the weight ``merge_and_unload`` gives, the one ``encode`` uses for a saved
adapter; results differ from PEFT's own forward by float32 rounding. Adapters PEFT would not merge the same
way (DoRA and other variants, a bias on B, dropout in training mode) keep PEFT's forward. So does every LoRA
layer of a model loaded with ``merge_adapter: false``, which asks for the adapter apart: its encoder's
``decode_options`` turn ``merge_adapters`` off, and its base and adapter products are packed each on its own.

A single row (a query decoded alone: every step of a search box's ``encode_query``) is a
matrix-vector product. For a weight that is not square, MKL streams it faster along its longer
side than oneDNN reads the blocked layout, at one thread and at two (decisions/D021;
on an AVX2 CPU up to 1.9x at one thread): stored transposed (in_features × out_features) where
out_features > in_features (gate/up, the LM head), as stored (dot products over long rows) where
it is smaller (k/v, down). Square weights (q/o) keep the packed layout, which two threads read
faster. Float32 one-row calls run that way; a transposed copy (or a LoRA layer's merged weight) is
made at a layer's first one-row call, so batch work never pays for it, and dropped with the packed
one. Its memory: the wider layers again (SmolLM2-135M: 81M of its 135M weights, 326 MB in float32),
once a process has decoded a single row. The choice follows the shape alone, so an embedding does
not depend on the thread count through it.

``packed_linears(model, enabled=False)`` does nothing; rollouts pass
``DecodeOptions.packed_linears`` and ``DecodeOptions.merge_adapters`` (:mod:`grace_st.runtime.decoding`) there.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grace_st.runtime.weights import tensor_change_key


class _Layouts:
    """A layer's weight as its products read it fastest: ``packed`` (oneDNN's blocked layout) for
    calls of several rows and for one row of a square weight, ``one_row`` (float32, made on first
    use: the weight transposed or as stored, see the module docstring, and which of the two) for one
    row of any other."""

    __slots__ = ("key", "one_row", "packed", "square")

    def __init__(self, key: tuple, weight: Tensor):
        self.key, self.packed, self.one_row = key, torch.ops.mkldnn._reorder_linear_weight(weight), None
        self.square = weight.shape[0] == weight.shape[1]


# module -> its _Layouts, keyed by the tensor_change_key of the weight they were made from.
# Kept beside the modules, not on them: packed tensors are not picklable and must not reach a state dict.
_packed: weakref.WeakKeyDictionary[nn.Module, _Layouts] = weakref.WeakKeyDictionary()
_kernel_ok: bool | None = None  # None until the first packing in this process has been checked
# The calling thread's (or task's) block: layer -> the product it runs instead of its class's forward.
_active: contextvars.ContextVar[Mapping[nn.Module, Callable] | None] = contextvars.ContextVar(
    "grace_st_packed_linears", default=None
)
# Serialises what blocks share: the kernel check, packing into ``_packed``, one-row layouts, installing forwards.
_lock = threading.RLock()


class _PackedDispatch:
    """A packed layer's forward, installed once (module docstring): the product the calling thread's
    block holds for the layer, else the class's own forward. It holds the layer weakly (no reference
    cycle keeps a dropped model and its packed copies alive), and the model still pickles and
    deep-copies: a copy gets a dispatch of its own, bound to the copy."""

    def __init__(self, module: nn.Module):
        self.module = weakref.ref(module)

    def __call__(self, *args, **kwargs):
        module = self.module()
        active = _active.get()
        if active is not None:
            run = active.get(module)
            if run is not None:
                return run(*args, **kwargs)
        return type(module).forward(module, *args, **kwargs)

    def __reduce__(self):
        return _PackedDispatch, (self.module(),)

    def __deepcopy__(self, memo):
        return _PackedDispatch(copy.deepcopy(self.module(), memo))


def _ours(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _PackedDispatch)


def _install(module: nn.Module) -> None:
    if not _ours(module):
        module.forward = _PackedDispatch(module)


def runs_packed(module: nn.Module) -> bool:
    """Whether ``module`` runs on packed weights in the calling thread now (inside a block that packs it)."""
    active = _active.get()
    return active is not None and module in active


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


def _packed_weight(module: nn.Linear) -> _Layouts:
    key = tensor_change_key(module.weight)
    cached = _packed.get(module)
    if cached is None or cached.key != key:
        cached = _packed[module] = _Layouts(key, module.weight.detach())
    return cached


def _product(
    layouts: _Layouts, weight: Callable[[], Tensor], bias: Tensor | None, input: Tensor, one_row_layout: bool
) -> Tensor:
    """``F.linear(input, weight(), bias)`` on the layout that serves ``input``'s row count best."""
    if one_row_layout and not layouts.square and input.dtype == torch.float32 and input.numel() == input.shape[-1]:
        if layouts.one_row is None:
            with _lock:  # one copy, however many threads get here first
                if layouts.one_row is None:
                    full = weight()
                    transposed = full.shape[0] > full.shape[1]
                    layouts.one_row = (full.t().contiguous() if transposed else full, transposed)
        row, (laid, transposed) = input.reshape(1, -1), layouts.one_row
        if not transposed:
            output = F.linear(row, laid, bias)
        else:
            output = torch.mm(row, laid) if bias is None else torch.addmm(bias, row, laid)
        return output.view(*input.shape[:-1], -1)
    return torch.ops.mkldnn._linear_pointwise(input.contiguous(), layouts.packed, bias, "none", [], "")


def _packed_forward(module: nn.Linear, layouts: _Layouts, one_row_layout: bool, input: Tensor) -> Tensor:
    if input.dtype != module.weight.dtype or input.device.type != "cpu" or torch.is_grad_enabled():
        return F.linear(input, module.weight, module.bias)
    return _product(layouts, module.weight.detach, module.bias, input, one_row_layout)


def _patched_elsewhere(module: nn.Module) -> bool:
    return "forward" in module.__dict__ and not _ours(module)


def _lora_layer_class():
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # without PEFT installed there is no LoRA layer to merge
        return None
    return Linear


def _active_lora(module: nn.Module, dtypes: tuple[torch.dtype, ...], lora_class: type | None) -> list[str] | None:
    """The adapters to merge into a PEFT LoRA linear layer's packed weight, or None where the
    merged product would not equal PEFT's forward (or there is nothing to merge)."""
    if lora_class is None or not isinstance(module, lora_class) or _patched_elsewhere(module):
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


def _merged_weight(module: nn.Module, adapters: list[str]) -> Tensor:
    merged = module.base_layer.weight.detach().clone()
    for name in adapters:
        merged += module.get_delta_weight(name).detach()
    return merged


def _merged_key(module: nn.Module, adapters: list[str]) -> tuple:
    """A key that changes whenever a LoRA layer's merged weight may have: its base, its adapters, their scaling."""
    parts = [module.base_layer.weight] + [p.weight for name in adapters for p in (module.lora_A[name], module.lora_B[name])]
    return (tuple(tensor_change_key(part) for part in parts), tuple(float(module.scaling[name]) for name in adapters))


def _packed_merged_weight(module: nn.Module, adapters: list[str]) -> _Layouts:
    key = _merged_key(module, adapters)
    cached = _packed.get(module)
    if cached is None or cached.key != key:
        cached = _packed[module] = _Layouts(key, _merged_weight(module, adapters))
        _packed.pop(module.base_layer, None)  # the base alone is not run inside a block any more
    return cached


def _merged_lora_forward(
    module: nn.Module, layouts: _Layouts, adapters: list[str], one_row_layout: bool, input: Tensor, *args, **kwargs
) -> Tensor:
    # Anything PEFT would do differently (adapters switched off or merged inside the block, a
    # per-row adapter_names) and anything the packed kernel does not take (autograd, another
    # dtype or device) goes back to PEFT's own forward.
    base = module.base_layer
    if (
        args or kwargs or module.merged or module.disable_adapters or torch.is_grad_enabled()
        or input.dtype != base.weight.dtype or input.device.type != "cpu"
    ):
        return type(module).forward(module, input, *args, **kwargs)
    return _product(layouts, lambda: _merged_weight(module, adapters), base.bias, input, one_row_layout)


def _packable(module: nn.Module, dtypes: tuple[torch.dtype, ...]) -> bool:
    return (
        type(module) is nn.Linear
        and module.weight.dtype in dtypes
        and module.weight.device.type == "cpu"
        and (module.bias is None or module.bias.dtype == module.weight.dtype)
        and not _patched_elsewhere(module)  # someone else's forward: left to run as they made it
    )


def _products(model: nn.Module, merge_adapters: bool, one_row_layout: bool) -> dict[nn.Module, Callable] | None:
    """What a block over ``model`` runs: layer -> its packed product (packing what is new or changed,
    installing :class:`_PackedDispatch` where missing); None where the kernel failed its check. Under the lock."""
    global _kernel_ok
    with _lock:
        if _kernel_ok is None:
            _kernel_ok = _check_kernel()
        if not _kernel_ok:
            return None
        products, dtypes, inside_merged = {}, packed_dtypes(), set()
        lora_class = _lora_layer_class() if merge_adapters else None  # once a block, not once a module
        for module in model.modules():
            adapters = _active_lora(module, dtypes, lora_class)
            if adapters:
                layouts = _packed_merged_weight(module, adapters)
                products[module] = functools.partial(_merged_lora_forward, module, layouts, adapters, one_row_layout)
                inside_merged.update(id(child) for child in module.modules() if child is not module)
            elif id(module) not in inside_merged and _packable(module, dtypes):
                products[module] = functools.partial(_packed_forward, module, _packed_weight(module), one_row_layout)
            else:
                continue
            _install(module)
        return products


@contextlib.contextmanager
def packed_linears(
    model: nn.Module, enabled: bool = True, merge_adapters: bool = True, one_row_layout: bool = True
) -> Iterator[None]:
    """Run ``model``'s CPU float32 (and bfloat16) linear layers on oneDNN-packed weights inside the block.

    Does nothing unless ``enabled``, while autograd is on, on other devices and dtypes, or when
    :func:`packing_enabled` says no. Weights are packed on first use and reused until they change.
    ``merge_adapters``: PEFT LoRA layers run on their merged weight (module docstring); off,
    only their base and adapter products are packed, each on its own. ``one_row_layout``: float32
    calls of a single row run on the layout MKL streams fastest (module docstring); off, on the packed one.

    The block holds for the calling thread (or asyncio task) alone: other threads' forwards through the
    same layers run as their own blocks say (module docstring). In a nested block a layer the enclosing
    block packs runs as that block packed it.
    """
    if not enabled or torch.is_grad_enabled() or not packing_enabled():
        yield
        return
    products = _products(model, merge_adapters, one_row_layout)
    if not products:
        yield
        return
    enclosing = _active.get()
    token = _active.set(products if enclosing is None else {**products, **enclosing})
    try:
        yield
    finally:
        _active.reset(token)


def matmul_peak_flops(dtype: torch.dtype, size: int = 2048, trials: int = 4, seconds: float = 0.25) -> tuple[float, str]:
    """This machine's matmul peak in ``dtype``: the best of several timed runs of a large square
    product with each kernel the encoder may use (MKL through ``torch.mm``; oneDNN with a packed
    weight, see grace_st.runtime.cpu.packed_linear). Early runs read low (thread start-up, clock ramp) and a
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
