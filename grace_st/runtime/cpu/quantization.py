"""Weight-only int8 linear layers for CPU inference.

At batch 1 a decoding step reads every weight once and does two FLOPs a weight: its time is the
time to read the weights. int8 weights are a quarter of float32's bytes. Each output row keeps its
own scale (symmetric, per channel: ``w ≈ scale · q``, ``q`` in [-127, 127]); activations stay in the
model's dtype outside the layer and are rounded to bfloat16 inside it, because PyTorch's own
int8-weight kernel (``torch._weight_int8pack_mm``) is fast only with 16-bit activations on this
CPU (``benchmarks/latency.py`` measured float32 activations ~10× slower and torchao's
``Int8WeightOnlyConfig`` slower than float32 itself; decisions/D014).

Chosen at load, never saved: ``model_kwargs={"weight_quantization": "int8"}`` (sentence-transformers,
LangChain's and LlamaIndex's ``model_kwargs`` carry it), after any LoRA adapter is merged. The saved
weights stay float; a quantized model refuses to be saved, trained or run with gradients, since none
of those would be what the user asked for. Embeddings differ from float32 (the dev scoreboard
measures by how much); the same input still gives the same embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grace_st.runtime.cpu.packed_linear import native_bfloat16

SCHEMES = ("int8",)
# Up to this many rows a call takes the int8 kernel (memory-bound decoding); above it, a matmul on the
# int8 values: in bfloat16 where the CPU has bfloat16 kernels (at 512 rows 3x faster than the kernel and
# 2x faster than float32 on an AVX-512 BF16 CPU), else in float32 (an AVX2 CPU emulates bfloat16 matmuls,
# 6x slower than float32 there; decisions/D014).
KERNEL_MAX_ROWS = 16
LOAD_KEY = "weight_quantization"  # the model_kwargs key that asks for it


class Int8WeightOnlyLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` held as int8 rows and a bfloat16 scale a row (no gradient)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        # the kernel takes its scales in the activations' dtype: bfloat16 rounds each row's scale by at most
        # 2^-9 of itself, less than the int8 rounding of the row's weights
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.bfloat16_matmul = native_bfloat16()  # how many rows multiply (forward); fixed per machine

    def forward(self, input: Tensor) -> Tensor:
        if torch.is_grad_enabled() and input.requires_grad:
            raise RuntimeError(
                "a model loaded with weight_quantization='int8' is for inference only: load it without "
                "weight_quantization to train it or take gradients through it"
            )
        rows = input.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        scale = self.scale.to(torch.bfloat16)  # a module-wide .float() (sentence-transformers 5 calls one) casts buffers
        if rows.shape[0] <= KERNEL_MAX_ROWS:
            output = torch._weight_int8pack_mm(rows, self.qweight, scale)
        else:
            # Many rows (a prompt, a large batch) are compute-bound, where the int8 kernel is slower than
            # float32: a matmul on the int8 values (exact in bfloat16 and float32), then the scales. The same
            # inputs, scales and bfloat16 output as the kernel, so a text's embedding depends on its batch
            # (and the CPU) only by the order of the sums.
            dtype = torch.bfloat16 if self.bfloat16_matmul else torch.float32
            products = F.linear(rows.to(dtype), self.qweight.to(dtype)).float()
            output = (products * scale.float()).to(torch.bfloat16)
        output = output.to(input.dtype).reshape(*input.shape[:-1], self.out_features)
        return output if self.bias is None else output + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_weights(model: nn.Module, scheme: str) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (LM head included) by its int8 weight-only form, in
    place; returns ``model``. Embedding tables stay as they are (a lookup reads one row a token)."""
    if scheme not in SCHEMES:
        raise ValueError(f"weight_quantization={scheme!r}: expected one of {', '.join(SCHEMES)}")
    if any(type(m).__name__ == "PeftModel" or hasattr(m, "lora_A") for m in model.modules()):
        raise ValueError(
            "weight_quantization needs the adapter merged into the weights: load with merge_adapter=True (the default)"
        )
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError(
            "weight_quantization='int8' is a CPU kernel (torch._weight_int8pack_mm): load the model on the CPU"
        )
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8WeightOnlyLinear(child))
    model.requires_grad_(False)
    return model


def quantization_scheme(model: nn.Module) -> str | None:
    """``"int8"`` when :func:`quantize_weights` ran on ``model``, else None."""
    return "int8" if any(isinstance(m, Int8WeightOnlyLinear) for m in model.modules()) else None
