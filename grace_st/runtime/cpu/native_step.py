"""Decoding steps and the prompt pass of a Llama-family decoder as one native call each, on every
core (``native_step.c``).

A search box embeds one query at a time: a query that thinks 32 tokens takes 32 decoding steps at batch 1,
each a matrix-vector product with every weight. PyTorch runs those on one thread (MKL) or reads
its blocked layout slowly (oneDNN), and a step dispatches ~400 small operations around them, so
the loop reached 37-42 % of the bandwidth floor (decisions/D021, D025). ``encode`` over many texts
decodes 64 rows a step: there the products run near the matmul peak in PyTorch too, but the same
~400 operations on 64-row tensors, and the prompt pass's padding, left work% near 40 %.

The C step does a whole step (every layer, the final norm, the LM head) or the prompts' pass in
one call: the products on weights repacked into panels of 48 outputs (an AVX-512 kernel of 8 rows
by 48 outputs; one row streams the same panels), the norms, rotary embedding, cache writes,
attention and SiLU in between without leaving C, and the work handed out to the threads unit by
unit. A prompt pass feeds only the prompts' real tokens (left padding is skipped, its cache columns
zeroed). It runs transformers' LlamaDecoderLayer formulas on the same weights (a LoRA layer on its
merged weight, as :mod:`grace_st.runtime.cpu.packed_linear` merges it), so its hidden states and logits equal
PyTorch's to float32 rounding. Every output of a float32 product is one chain of fused
multiply-adds in a fixed order, so a row's result depends neither on the thread count nor on the
other rows of the batch: a text gets the same bits decoded alone or among 63 others, given the
same cache. Denormals are flushed to zero inside the call (a term below 1e-38).

Costs: the panels are a copy of the float32 weights (SmolLM2-135M: 540 MB), kept while the model
is; int8 weights (grace_st.runtime.cpu.quantization) are read as stored, for a single row's step only.

It is built with the system's C compiler at first use (``-O3 -march=native``; about a second) into
``$GRACE_ST_HOME/kernels``, keyed by the source, the flags and this CPU's feature flags; without
AVX-512 the same arithmetic is compiled from plain C. Where it does not apply, PyTorch runs the
step or pass as before: no C compiler (logged once), a model other than a plain Llama-family
decoder (biases, another activation, another block), weights other than float32 or
grace_st.runtime.cpu.quantization's int8 on the CPU (bfloat16), int8 weights and more than one token, autograd
on, or pooled states other than the last layer's (``hidden_layer`` -1).
``DecodeOptions(native_step=False)`` turns it off.

The kernel cache trusts only what it built: a cached library is loaded only where it and its folder
belong to this user and neither is group- or world-writable, and where its sha256 equals the record
(``<name>.sha256``, held to the same checks) written beside it when it was built; the file checked is
the file loaded (opened once, loaded through its descriptor). Anything else (a library someone else
could have planted or changed, a truncated one, one without the step's symbol) is never called: the
step is built again in its folder, or in a fresh private folder (mode 0700) when that folder is not
to be trusted, or PyTorch's step runs; each with one warning naming the file.

The C structs and the step's parameters are mirrored here by hand (``_Matrix``, ``_Layer``,
``STEP_ARGTYPES``): a library exports its own sizes, offsets and parameter count
(``grace_layer_size`` and the like, from sizeof and offsetof), and one that disagrees with the
mirror is never called: PyTorch's step runs, with one warning naming the mismatch
(:class:`ContractMismatch`). Rebuilding would not help (the same source gives the same layout).

Threads: a call keeps its scratch memory and worker threads to itself (allocated a call in
``native_step.c``), and a thread's cache buffers to a table of its own (:meth:`NativeStep._bind_cache`),
so calls from several threads run at once, unlocked. Building the library and binding a model's
weights (its panels, made once and shared) are serialised by this module's locks. Starting and joining a
call's worker threads costs about 20 µs (one extra thread on this project's 2-core reference machine)
against a decoding step of about 26 ms (the shipped default, float32, one query), so a pool kept between
calls would save about 0.1 % and is not kept.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import itertools
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
import weakref
from pathlib import Path

import torch
from torch import Tensor, nn

from grace_st.runtime.cpu.packed_linear import _active_lora, _lora_layer_class, _merged_key, _merged_weight
from grace_st.runtime.home import grace_home

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "native_step.c"
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-pthread"]
PRODUCTS = ("q", "k", "v", "o", "gate", "up", "down")


class _Matrix(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("scale", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        *[(name, _Matrix) for name in PRODUCTS],
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
    ]


# grace_native_step's parameters, in the order of its prototype in native_step.c
STEP_ARGTYPES = (
    ctypes.POINTER(_Layer),
    ctypes.c_int,
    ctypes.c_void_p,
    _Matrix,
    *[ctypes.c_int] * 7,  # tokens, vocab, hidden, intermediate, heads, kv_heads, head_dim
    ctypes.c_float,
    ctypes.c_float,
    ctypes.c_int,  # capacity
    *[ctypes.c_void_p] * 3,  # cache_rows, columns, mask
    ctypes.c_int,  # mask_width
    *[ctypes.c_void_p] * 3,  # embedding, cos, sin
    ctypes.c_int,  # logit_tokens
    *[ctypes.c_void_p] * 3,  # logit_index, states_out, logits_out
    ctypes.c_int,  # threads
)
# the structs whose layout the library exports, by the prefix of its functions (grace_layer_size, ...)
MIRRORED = (("matrix", "Matrix", _Matrix), ("layer", "Layer", _Layer))


_library_state: dict = {}
_library_lock = threading.Lock()  # one build and one load a process, however many threads ask first
_bind_lock = threading.Lock()  # one binding (panels) a model, however many threads ask first
# Part of the cache key: libraries cached before their sha256 was recorded are not looked at.
CACHE_FORMAT = "sha256-record-1"
SYMBOLS = ("grace_native_step", "grace_native_step_panel")
_loads = itertools.count()


class _Untrusted(Exception):
    """A cached library (or its folder, or its record) that is not to be loaded; the message says why."""


class ContractMismatch(_Untrusted, RuntimeError):
    """A library whose structs or step parameters differ from this module's ctypes mirror of them: calling it
    would hand the C side misplaced pointers. Never called; PyTorch's step runs instead."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _check_owned(info: os.stat_result, what: str) -> None:
    """``what`` belongs to this user and no one else can write it."""
    if info.st_uid != os.getuid():
        raise _Untrusted(f"{what} belongs to user id {info.st_uid}, not to this user ({os.getuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _Untrusted(f"{what} is group- or world-writable (mode {stat.S_IMODE(info.st_mode):o})")


def _open_folder(folder: Path) -> int:
    """A descriptor of ``folder``, created (mode 0700) if missing, after checking it is this user's alone."""
    if not folder.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        info = os.fstat(descriptor)
        _check_owned(info, f"the kernel cache folder {folder}")
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _open_regular(name: str, folder: int, where: Path) -> int:
    """A descriptor of the regular file ``name`` in the folder (not through a link), this user's alone."""
    try:
        descriptor = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
    except OSError as error:
        if error.errno == errno.ENOENT:
            raise
        raise _Untrusted(f"{where / name} cannot be opened as a plain file ({error})") from error
    info = os.fstat(descriptor)
    try:
        if not stat.S_ISREG(info.st_mode):
            raise _Untrusted(f"{where / name} is not a plain file")
        _check_owned(info, str(where / name))
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _sha256(descriptor: int) -> str:
    digest = hashlib.sha256()
    with os.fdopen(os.dup(descriptor), "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _verified(name: str, folder: int, where: Path) -> int:
    """A descriptor of the cached library ``name`` once it and its sha256 record passed every check
    (module docstring): FileNotFoundError where there is no library, :class:`_Untrusted` for the rest."""
    library = _open_regular(name, folder, where)
    try:
        try:
            record = _open_regular(name + ".sha256", folder, where)
        except FileNotFoundError as error:
            raise _Untrusted(
                f"{where / name} has no sha256 record: grace-st did not build it (or not to the end)"
            ) from error
        with os.fdopen(record, "rb") as stream:
            expected = stream.read(200).decode(errors="replace").split()
        if expected[:1] != [_sha256(library)]:
            raise _Untrusted(
                f"{where / name} does not match its sha256 record (truncated, or changed since it was built)"
            )
    except BaseException:
        os.close(library)
        raise
    return library


def _compile(compiler: str, target: Path) -> None:
    """Build the library as ``target`` with its sha256 record beside it: built beside its final name,
    then renamed, so another process never loads a half-written library."""
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        # $CC may carry flags of its own ("gcc -O2", "ccache cc"), as make reads it: split as a shell would
        command = [*shlex.split(compiler), *FLAGS, "-o", str(built), str(SOURCE), "-lm"]
        subprocess.run(command, check=True, capture_output=True)
        os.chmod(built, 0o755)  # whatever the umask: a group-writable library would be refused when loaded
        digest = hashlib.sha256(built.read_bytes()).hexdigest()
        record = Path(scratch) / (target.name + ".sha256")
        record.write_text(f"{digest}  {target.name}\n")
        os.chmod(record, 0o644)
        os.replace(built, target)
        os.replace(record, target.with_name(target.name + ".sha256"))


def _load(descriptor: int, path: Path):
    """dlopen the checked file itself (through its descriptor where /proc has one, else ``path``) and
    check its two symbols and its contract (:func:`check_contract`)."""
    # The dynamic loader hands back a library it loaded before under the same name without opening
    # anything, and descriptor numbers come back: each load gets a name of its own.
    through = f"/proc/self/{'./' * next(_loads)}fd/{descriptor}"
    try:
        built = ctypes.CDLL(through if os.path.exists(through) else str(path))
    except OSError as error:
        raise _Untrusted(f"cannot be loaded ({error})") from error
    missing = [name for name in SYMBOLS if not hasattr(built, name)]
    if missing:
        raise _Untrusted(f"has no {', '.join(missing)}: not the native step's library")
    check_contract(built)
    return built


def _exported(built, name: str, restype):
    function = getattr(built, name)
    function.restype, function.argtypes = restype, [ctypes.c_int] if name.endswith("_offset") else []
    return function


def contract_mismatches(built) -> list[str]:
    """How the library ``built`` disagrees with this module's ctypes mirror of its structs and step
    parameters (empty: they agree); each item names a size, an offset or the parameter count."""
    names = [f"grace_{prefix}_{what}" for prefix, _, _ in MIRRORED for what in ("size", "field_count", "offset")]
    missing = [name for name in [*names, "grace_step_arg_count"] if not hasattr(built, name)]
    if missing:
        return [f"the library exports no {', '.join(missing)} (built from another source)"]
    found = []
    for prefix, c_name, mirror in MIRRORED:
        size = _exported(built, f"grace_{prefix}_size", ctypes.c_size_t)()
        if size != ctypes.sizeof(mirror):
            found.append(f"struct {c_name} is {size} bytes in the library, {ctypes.sizeof(mirror)} in ctypes")
        count = _exported(built, f"grace_{prefix}_field_count", ctypes.c_int)()
        if count != len(mirror._fields_):
            found.append(f"struct {c_name} has {count} fields in the library, {len(mirror._fields_)} in ctypes")
        offset = _exported(built, f"grace_{prefix}_offset", ctypes.c_size_t)
        pairs = [
            (field, offset(index), getattr(mirror, field).offset)
            for index, (field, _) in enumerate(mirror._fields_[:count])
        ]
        moved = [
            f"{c_name} field {f!r} at offset {theirs} in the library, {ours} in ctypes"
            for f, theirs, ours in pairs
            if theirs != ours
        ]
        # the first few say where the layouts part; every field after an inserted one moves with it
        found += moved[:3] + ([f"{len(moved) - 3} more {c_name} fields moved"] if len(moved) > 3 else [])
    arguments = _exported(built, "grace_step_arg_count", ctypes.c_int)()
    if arguments != len(STEP_ARGTYPES):
        found.append(f"grace_native_step takes {arguments} arguments in the library, {len(STEP_ARGTYPES)} in ctypes")
    return found


def check_contract(built) -> None:
    """Raise :class:`ContractMismatch`, naming the differences, where :func:`contract_mismatches` finds any."""
    found = contract_mismatches(built)
    if found:
        raise ContractMismatch(f"is refused: native kernel contract mismatch: {'; '.join(found)}")


def _load_or_warn(descriptor: int, path: Path):
    """:func:`_load` of a verified library, closing its descriptor; None, with one warning, where it fails."""
    try:
        return _load(descriptor, path)
    except _Untrusted as error:
        _warn(f"{path} {error}; PyTorch's own step runs", stacklevel=5)
        return None
    finally:
        os.close(descriptor)


def _warn(message: str, stacklevel: int = 4) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def _cached_or_built(compiler: str, name: str):
    """The library ``name`` from the kernel cache, built there first if missing or untrusted; from a
    fresh private folder where the cache folder is not to be trusted; None (with a warning) if neither loads."""
    home = grace_home() / "kernels"
    try:
        folder = _open_folder(home)
    except _Untrusted as error:
        _warn(
            f"{error}: it is not used; the native step is built in a private folder instead (chmod go-w the folder, "
            "or set GRACE_ST_HOME to a folder of your own, to cache it)"
        )
        return _built_privately(compiler, name)
    try:
        lock = os.open(name + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=folder)
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time across processes; the next one loads it
            try:
                descriptor = _verified(name, folder, home)
            except FileNotFoundError:
                _compile(compiler, home / name)
                descriptor = _verified(name, folder, home)
            except _Untrusted as error:
                _warn(f"{error}: it is not loaded; the native step is built again")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=folder)
                _compile(compiler, home / name)
                descriptor = _verified(name, folder, home)
        finally:
            os.close(lock)
        return _load_or_warn(descriptor, home / name)
    finally:
        os.close(folder)


def _built_privately(compiler: str, name: str):
    """Build into a fresh folder only this process knows (mode 0700), load, and remove the folder
    (the loaded library stays mapped)."""
    with tempfile.TemporaryDirectory(prefix="grace_st_kernels-") as scratch:
        os.chmod(scratch, 0o700)
        _compile(compiler, Path(scratch) / name)
        folder = _open_folder(Path(scratch))
        try:
            descriptor = _verified(name, folder, Path(scratch))
        finally:
            os.close(folder)
        return _load_or_warn(descriptor, Path(scratch) / name)


def library():
    """The compiled step's entry point, or None where it cannot be built here (logged once), or a
    cached library fails its checks and cannot be rebuilt (one warning naming the file)."""
    if "function" in _library_state:
        return _library_state["function"]
    with _library_lock:
        if "function" not in _library_state:
            _library_state["function"] = _build_and_load()
    return _library_state["function"]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_name(compiler: str) -> str:
    """The cached library's file name in ``$GRACE_ST_HOME/kernels``: keyed by the source, the compiler,
    the flags and this CPU's features (anyone can compute it: the checks, not the name, keep it safe)."""
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), compiler, *FLAGS, platform.machine(), _cpu_flags(), CACHE_FORMAT]).encode()
    )
    return f"native_step-{key.hexdigest()[:16]}.so"


def _build_and_load():
    function = None
    compiler = _compiler()
    if compiler is None or platform.system() == "Windows":
        logger.info("no C compiler found: decoding runs PyTorch's own step")
        return None
    name = library_name(compiler)
    try:
        built = _cached_or_built(compiler, name)
        if built is not None:
            function, _library_state["panel"] = built.grace_native_step, built.grace_native_step_panel()
    except _Untrusted as error:  # a library just built that fails its own checks (a private folder gone wrong)
        _warn(f"{error}; PyTorch's own step runs")
    except (OSError, ValueError, subprocess.CalledProcessError) as error:  # ValueError: unbalanced quotes in $CC
        detail = getattr(error, "stderr", b"") or b""
        # a compiler the user chose (CC) that fails is worth a warning; the system's fallback, a note
        logger.log(
            logging.WARNING if os.environ.get("CC") else logging.INFO,
            "the native step could not be built with %r (%s %s): PyTorch's own step runs",
            compiler,
            error,
            detail.decode(errors="replace")[-500:],
        )
    if function is not None:
        function.restype = ctypes.c_int
        function.argtypes = list(STEP_ARGTYPES)  # as many as the library said it takes (check_contract)
    return function


def _pointer(tensor: Tensor) -> int:
    return tensor.data_ptr()


# A LoRA layer's merged weight, kept until the base or the adapter changes (packed_linear's key).
_merged: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Tensor]] = weakref.WeakKeyDictionary()


def _product(module: nn.Module, lora_class) -> tuple[Tensor, Tensor | None] | None:
    """What a product with ``module`` multiplies by: (float32 weight, None), a LoRA layer's merged
    weight, or (int8 rows, float32 scale a row) for grace_st.runtime.cpu.quantization's layer; None otherwise."""
    from grace_st.runtime.cpu.quantization import Int8WeightOnlyLinear

    if type(module) is Int8WeightOnlyLinear:
        if module.bias is not None or module.qweight.device.type != "cpu":
            return None
        return module.qweight.contiguous(), module.scale.float().contiguous()
    if type(module) is nn.Linear:
        weight = module.weight
    else:
        adapters = _active_lora(module, (torch.float32,), lora_class)
        if not adapters:
            return None
        key = _merged_key(module, adapters)
        cached = _merged.get(module)
        if cached is None or cached[0] != key:
            cached = _merged[module] = (key, _merged_weight(module, adapters))
        weight, module = cached[1], module.base_layer
    if module.bias is not None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    return weight.detach().contiguous(), None


# model -> (the identity of its tensors, its bound step or None), see NativeStep.for_model
_steps: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, NativeStep | None]] = weakref.WeakKeyDictionary()


def _has_lora(model: nn.Module) -> bool:
    lora_class = _lora_layer_class()
    return lora_class is not None and any(isinstance(module, lora_class) for module in model.modules())


def _panels(weight: Tensor, width: int) -> Tensor:
    """``weight`` (outputs x inputs) as native_step.c's panels: ``width`` outputs a panel, each laid
    out input-major, the last one padded with zero rows."""
    outputs, inputs = weight.shape
    padded = torch.nn.functional.pad(weight, (0, 0, 0, -outputs % width))
    return padded.view(-1, width, inputs).transpose(1, 2).contiguous()


def _packed(product: tuple[Tensor, Tensor | None], width: int) -> tuple[Tensor, Tensor | None]:
    """A float32 product's weight as panels; int8 rows stay as they are (native_step.c reads them a row at a time)."""
    weight, scale = product
    return (weight, scale) if scale is not None else (_panels(weight, width), None)


def _matrix(product: tuple[Tensor, Tensor | None]) -> _Matrix:
    weight, scale = product
    return _Matrix(_pointer(weight), None if scale is None else _pointer(scale))


def _supported_config(config) -> bool:
    return (
        getattr(config, "model_type", None) == "llama"
        and getattr(config, "hidden_act", None) == "silu"
        and not getattr(config, "attention_bias", False)
        and not getattr(config, "mlp_bias", False)
        and getattr(config, "pretraining_tp", 1) == 1
    )


class NativeStep:
    """The C step bound to a model's weights: :meth:`__call__` feeds a token a row to a
    :func:`grace_st.runtime.decoding.preallocated_cache`, :meth:`prefill` the prompts' tokens; both return
    the final normed hidden states and the next-token logits, as the model's forward would. Made by
    :meth:`for_model`."""

    def __init__(
        self, function, decoder: nn.Module, layers: list[dict], final_norm: Tensor, lm_head: tuple, vocab: int
    ):
        self.function, self.decoder = function, decoder
        # kept alive: the C side holds raw pointers to them
        self.tensors, self.final_norm, self.lm_head = layers, final_norm, lm_head
        self.lm_head_matrix = _matrix(lm_head)
        self.int8 = lm_head[1] is not None
        self.table = (_Layer * len(layers))()
        for slot, layer in zip(self.table, layers):
            slot.input_norm, slot.post_norm = _pointer(layer["input_norm"]), _pointer(layer["post_norm"])
            for name in PRODUCTS:
                setattr(slot, name, _matrix(layer[name]))
        config = decoder.config
        self.hidden, self.vocab = config.hidden_size, vocab
        attention = decoder.layers[0].self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attention.head_dim
        self.intermediate = config.intermediate_size
        self.eps = float(decoder.layers[0].input_layernorm.variance_epsilon)
        self.scale = float(attention.scaling)
        self.local = threading.local()  # _bind_cache's table, one a thread

    @classmethod
    def for_model(cls, model: nn.Module, merge_adapters: bool = True) -> NativeStep | None:
        """The step for ``model`` if it applies (module docstring), else None. Kept for the next call
        while the model's tensors are the same ones: the step reads them in place, so values written
        into them are seen; a LoRA layer's merged weight is a copy, so such a model is bound anew each call.
        The step runs a LoRA layer only on its merged weight: without ``merge_adapters`` a model with one has
        no step. Under a lock: threads asking at once share one binding (the panels are a copy of the weights)."""
        if not merge_adapters and _has_lora(model):
            return None
        key = tuple((t.data_ptr(), t._version) for t in (*model.parameters(), *model.buffers()))
        with _bind_lock:
            cached = _steps.get(model)
            if cached is not None and cached[0] == key:
                return cached[1]
            step = cls._bind(model)
            if not _has_lora(model):
                _steps[model] = (key, step)
            return step

    @classmethod
    def _bind(cls, model: nn.Module) -> NativeStep | None:
        decoder = model.get_decoder()
        config = getattr(decoder, "config", None)
        if config is None or not _supported_config(config) or type(decoder).__name__ != "LlamaModel":
            return None
        if type(decoder.embed_tokens) is not nn.Embedding or decoder.embed_tokens.weight.dtype != torch.float32:
            return None
        head = model.get_output_embeddings()
        function = library()
        if function is None or head is None:
            return None
        lora_class = _lora_layer_class()
        layers = []
        for layer in decoder.layers:
            attention, mlp = layer.self_attn, layer.mlp
            if type(layer).__name__ != "LlamaDecoderLayer" or getattr(attention, "sliding_window", None):
                return None
            products = {name: _product(getattr(attention, f"{name}_proj"), lora_class) for name in "qkvo"}
            products.update(
                {name: _product(getattr(mlp, f"{name}_proj"), lora_class) for name in ("gate", "up", "down")}
            )
            norms = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight}
            if any(p is None for p in products.values()) or any(n.dtype != torch.float32 for n in norms.values()):
                return None
            layers.append({**products, **{name: n.detach().contiguous() for name, n in norms.items()}})
        lm_head = _product(head, lora_class)
        norm = decoder.norm.weight.detach()
        if lm_head is None or norm.dtype != torch.float32:
            return None
        # one kind of weight throughout: the C step rounds activations to bfloat16 around every int8 product
        if len({lm_head[1] is None} | {p[1] is None for layer in layers for p in (layer[n] for n in PRODUCTS)}) > 1:
            return None
        width = _library_state["panel"]
        layers = [
            {name: _packed(value, width) if name in PRODUCTS else value for name, value in layer.items()}
            for layer in layers
        ]
        return cls(function, decoder, layers, norm.contiguous(), _packed(lm_head, width), lm_head[0].shape[0])

    def allocate(self, kv_cache, rows: int) -> None:
        """Give a :func:`grace_st.runtime.decoding.preallocated_cache` nothing was written to its buffers for
        ``rows`` rows (what its first write would have done)."""
        empty = torch.empty(rows, self.kv_heads, 0, self.head_dim)
        for layer in kv_cache.layers:
            layer.lazy_initialization(empty, empty)

    def takes(self, rows: int, columns: int = 1) -> bool:
        """Whether this step computes ``columns`` tokens of ``rows`` rows at all: autograd off, and int8
        weights for one token only (a single row's decoding step)."""
        return rows >= 1 and not (self.int8 and rows * columns > 1) and not torch.is_grad_enabled()

    def applies(self, kv_cache, rows: int, columns: int = 1) -> bool:
        """Whether this step can feed ``columns`` more columns of ``rows`` rows into ``kv_cache``
        (:meth:`takes`, and every layer preallocated for those rows, contiguous and with room)."""
        if not self.takes(rows, columns) or kv_cache is None:
            return False
        layers = getattr(kv_cache, "layers", ())
        if len(layers) != len(self.table) or not all(getattr(layer, "_keys", None) is not None for layer in layers):
            return False
        return self._bind_cache(layers, rows) and layers[0].length + columns <= layers[0].capacity

    def _bind_cache(self, layers, rows: int) -> bool:
        """This thread's table with the cache's buffers filled in, made when the buffers change (and
        checked then): two threads encoding with one model at once must not write into each other's cache.
        Both buffers of every layer name the table: a new cache can get a freed cache's keys' address and
        values elsewhere, and a table kept by the keys alone would write into the freed values."""
        bound = tuple((layer._keys.data_ptr(), layer._values.data_ptr(), layer._keys.shape[0]) for layer in layers)
        if getattr(self.local, "bound", None) == bound:
            return bound[0][2] == rows
        if not all(
            layer._keys.shape[0] == rows
            and layer._keys.dtype == torch.float32
            and layer._keys.is_contiguous()
            and layer._values.is_contiguous()
            for layer in layers
        ):
            return False
        table = (_Layer * len(self.table))()
        ctypes.memmove(table, self.table, ctypes.sizeof(self.table))
        for slot, layer in zip(table, layers):
            slot.key_cache, slot.value_cache = _pointer(layer._keys), _pointer(layer._values)
        self.local.table, self.local.bound = table, bound
        return True

    def __call__(self, tokens, kv_cache, mask: Tensor, positions, threads: int) -> tuple[Tensor, Tensor] | None:
        """A decoding step: feed ``tokens`` (one a cache row) at ``positions`` on ``threads`` threads into
        ``kv_cache``'s next column; ``mask``: each row's attention mask over the cache's columns, the
        new one included. Returns states (rows, 1, hidden) and logits (rows, vocab), or None when the
        native step could not get its memory or threads (nothing written)."""
        tokens = torch.as_tensor(tokens).reshape(-1)
        rows, length = len(tokens), kv_cache.layers[0].length
        mask = mask.reshape(rows, -1)
        if mask.shape[-1] != length + 1:
            raise ValueError(f"the mask covers {mask.shape[-1]} columns, the cache {length} and the new token")
        cache_rows = torch.arange(rows, dtype=torch.int32)
        columns = torch.full((rows,), length, dtype=torch.int32)
        ran = self._run(
            kv_cache, tokens, cache_rows, columns, mask, torch.as_tensor(positions).reshape(-1), None, threads
        )
        if ran is None:
            return None
        states, logits = ran
        return states[:, None], logits

    def prefill(
        self, input_ids: Tensor, kv_cache, mask: Tensor, positions: Tensor, logits: bool, threads: int,
        inputs_embeds: Tensor | None = None,
    ):
        """The prompt pass: feed left-padded ``input_ids`` (rows x width) at ``positions`` into the
        next ``width`` columns of ``kv_cache``, where ``mask`` (rows x (cache length + width)) has
        the row's own tokens; padding is not computed (its columns are zeroed, and masked).
        ``inputs_embeds`` (rows x width x hidden): the vectors fed, in place of the ids' embeddings. Returns
        the final normed states (rows, width, hidden; zeros on padding) and the last column's
        logits (None unless ``logits``), or None when the native step could not get its memory or
        threads (nothing written)."""
        rows, width = input_ids.shape
        length = kv_cache.layers[0].length
        if mask.shape != (rows, length + width):
            raise ValueError(f"the mask is {tuple(mask.shape)}, the cache has {length} columns and {width} come")
        cache_rows, offsets = mask[:, length:].nonzero(as_tuple=True)
        # the last column: every row's last prompt token (left padding), the one that gets logits; none without
        last = (offsets == width - 1).nonzero().reshape(-1) if logits else offsets.new_empty(0)
        if logits and len(last) != rows:
            raise ValueError("every row's prompt must end at the last column (left padding)")
        for layer in kv_cache.layers:  # padding is never written: zeros, not whatever the buffer held
            layer._keys[:, :, length : length + width] = 0
            layer._values[:, :, length : length + width] = 0
        ran = self._run(
            kv_cache,
            input_ids[cache_rows, offsets],
            cache_rows.to(torch.int32),
            (offsets + length).to(torch.int32),
            mask,
            positions[cache_rows, offsets],
            last.to(torch.int32),
            threads,
            advance=width,
            embedding=None if inputs_embeds is None else inputs_embeds[cache_rows, offsets],
        )
        if ran is None:
            return None
        states, last_logits = ran
        padded = states.new_zeros((rows, width, self.hidden))
        padded[cache_rows, offsets] = states
        return padded, last_logits

    def _run(
        self, kv_cache, tokens, cache_rows, columns, mask, positions, logit_index, threads, advance: int = 1,
        embedding: Tensor | None = None,
    ):
        """grace_native_step over ``tokens`` (see native_step.c), logits for the tokens in ``logit_index`` (every
        token if None; none if empty); moves the cache ``advance`` columns on. ``embedding``: the tokens' input
        vectors, where they are not the ids' own (GRC's latents)."""
        layers = kv_cache.layers
        if not self._bind_cache(layers, int(mask.shape[0])):
            raise ValueError("the native step takes a contiguous float32 cache of a row a mask row (see applies)")
        table = self.local.table
        if layers[0].length + advance > layers[0].capacity:
            raise RuntimeError(f"KV cache of {layers[0].capacity} positions cannot hold {layers[0].length + advance}")
        count = len(tokens)
        if embedding is None:
            embedding = self.decoder.embed_tokens.weight[tokens]
        embedding = embedding.to(torch.float32).contiguous()
        cos, sin = self.decoder.rotary_emb(embedding[:, None], positions.reshape(count, 1))
        cos, sin = cos.reshape(count, -1).float().contiguous(), sin.reshape(count, -1).float().contiguous()
        mask_bytes = mask.to(torch.uint8).contiguous()
        cache_rows, columns = cache_rows.contiguous(), columns.contiguous()
        picked = count if logit_index is None else len(logit_index)
        states = torch.empty(count, self.hidden)
        scores = torch.empty(picked, self.vocab) if picked else None
        status = self.function(
            table,
            len(table),
            _pointer(self.final_norm),
            self.lm_head_matrix,
            count,
            self.vocab,
            self.hidden,
            self.intermediate,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.eps,
            self.scale,
            layers[0].capacity,
            _pointer(cache_rows),
            _pointer(columns),
            _pointer(mask_bytes),
            mask_bytes.shape[1],
            _pointer(embedding),
            _pointer(cos),
            _pointer(sin),
            picked,
            None if logit_index is None else _pointer(logit_index.contiguous()),
            _pointer(states),
            None if scores is None else _pointer(scores),
            threads,
        )
        if status != 0:  # no memory or no thread: nothing was written, the caller runs PyTorch's step
            return None
        for layer in layers:
            layer.advance(advance)
        return states, scores
