"""What identifies a model's weights: a digest for keys and names, a cheap change key for repacking.

:func:`weights_fingerprint` keys the rationale cache's entries (:mod:`grace_st.cache`), names the
revision mteb files results under and is checked when a saved model loads; :func:`tensor_change_key`
tells the encoder and the packed kernels (:mod:`grace_st.runtime.cpu.packed_linear`) when a weight may have changed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

# Config entries that do not change a forward pass: where the model was loaded from, library
# bookkeeping, output switches, and the dtype (each tensor's own dtype is hashed). Leaving a
# harmless entry in only costs cache misses; leaving a relevant one out would give wrong hits.
_CONFIG_KEYS_NOT_HASHED = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "architectures",
        "dtype",
        "torch_dtype",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "use_cache",
        "id2label",
        "label2id",
        "_attn_implementation",
        "_attn_implementation_autoset",
    }
)


def tensor_change_key(tensor) -> tuple:
    """A cheap key that changes whenever a tensor's values may have: its storage, its version
    counter (in-place updates: optimizer steps, ``load_state_dict``) and its sum (writes through
    ``.data``, which the version counter does not see). One read of the tensor, no hashing."""
    return (tensor.data_ptr(), tensor._version, tuple(tensor.shape), str(tensor.dtype), float(tensor.detach().sum()))


def weights_fingerprint(model, state_dict: Mapping[str, Any] | None = None) -> str:
    """A sha256 hex digest of a torch module's weights and the config that shapes its forward pass.

    Covers every parameter and buffer (non-persistent ones too, e.g. rotary frequencies): its
    name, dtype, shape and raw bytes, in sorted name order, so the same weights give the same
    digest whatever device they sit on, and any changed value, dtype or shape gives another.
    When the module has a transformers ``config``, its values are hashed too (less entries such
    as the load path or library version that do not change the result): e.g. ``rms_norm_eps``
    is in no tensor. Cost: one sha256 pass over the weights, about 0.3 s for a 135M-parameter
    float32 model (540 MB) on a CPU with SHA instructions, plus the copy to host for GPU weights.

    ``state_dict``: weights about to be saved in place of the model's own (gathered shards): the
    digest the model will have once loaded from them.
    """
    import torch

    # The rationale cache's name in the prefix: the digests of earlier versions stay valid.
    digest = hashlib.sha256(b"grace-st-rationale-cache/weights/v1\n")
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        tensors.setdefault(name, tensor)
    for name in tensors.keys() & (state_dict or {}).keys():
        tensors[name] = state_dict[name]
    with torch.no_grad():
        for name in sorted(tensors):
            tensor = tensors[name].detach()
            if tensor.device.type == "meta":
                raise ValueError(f"weights_fingerprint: {name} is on the meta device, it has no values to hash")
            header = json.dumps([name, str(tensor.dtype), list(tensor.shape)])
            digest.update(f"{len(header)}:{header}".encode())
            data = tensor.contiguous().reshape(-1)
            if data.numel():
                # A byte view: hashes every dtype (bfloat16, float8 ...) without conversion.
                digest.update(data.view(torch.uint8).cpu().numpy().data)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        values = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_KEYS_NOT_HASHED}
        digest.update(b"config:" + json.dumps(values, sort_keys=True, default=str).encode())
    return digest.hexdigest()
