"""The single-row decoding step as one native call (grace_st.runtime.cpu.native_step) against PyTorch's step."""

import ctypes
import logging
import os
import platform

import pytest
import torch
from conftest import make_lora_model, make_model, make_prompts, make_tokenizer, one_pass_rollouts

from grace_st.runtime.cpu import native_step
from grace_st.runtime.cpu.native_step import NativeStep
from grace_st.runtime.decoding import DecodeOptions
from grace_st.runtime.transformers_compat import cache_kwargs

needs_compiler = pytest.mark.skipif(native_step.library() is None, reason="no C compiler to build the native step")
PYTORCH_STEP = DecodeOptions(native_step=False)


def _count_calls(monkeypatch, method: str) -> list[bool]:
    """Whether each call of NativeStep.<method> ran natively (the test fails if the kernel silently never ran)."""
    calls = []
    original = getattr(NativeStep, method)

    def counted(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(NativeStep, method, counted)
    return calls


@pytest.fixture
def native_calls(monkeypatch):
    """The decoding steps."""
    return _count_calls(monkeypatch, "__call__")


@pytest.fixture
def native_prefills(monkeypatch):
    """The prompt passes."""
    return _count_calls(monkeypatch, "prefill")


def _assert_same(native, pytorch):
    assert torch.equal(native.rationale_ids, pytorch.rationale_ids)
    assert torch.equal(native.pooling_mask, pytorch.pooling_mask)
    torch.testing.assert_close(native.token_embeddings, pytorch.token_embeddings, atol=1e-5, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_row_decoded_alone_gets_pytorch_s_rationale_and_states(tied, do_sample, native_calls, native_prefills):
    """Its prompt pass (into a cache nothing was written to yet) and every step run natively."""
    tokenizer, _, rows, spans = make_prompts()
    model = make_model(tokenizer, tied=tied)
    for row, span in zip(rows, spans):
        decoding = {"do_sample": do_sample, "seeds": [11] if do_sample else None}
        native = one_pass_rollouts(model, tokenizer, [row], [span], 12, **decoding)
        pytorch = one_pass_rollouts(model, tokenizer, [row], [span], 12, options=PYTORCH_STEP, **decoding)
        _assert_same(native, pytorch)
    assert len(native_calls) >= 11 * len(rows) and all(native_calls)
    # each row's prompt after the instruction prefix, which runs once and is kept (grace_st.runtime.prefix_cache)
    assert all(native_prefills) and len(native_prefills) == len(rows) + 1


@needs_compiler
def test_the_step_s_logits_and_cache_equal_the_model_s_forward():
    """One step straight against transformers' forward: the keys and values it writes, the final
    normed state and every logit."""
    from grace_st.runtime.decoding import preallocated_cache

    _, model, rows, _ = make_prompts()
    ids = torch.tensor([rows[2]])
    with torch.no_grad():
        caches = [preallocated_cache(model, ids.shape[1] + 1) for _ in range(2)]
        for cache in caches:
            model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
        expected = model(
            input_ids=torch.tensor([[7]]), **cache_kwargs(model, caches[0]), use_cache=True, output_hidden_states=True
        )
        step = NativeStep.for_model(model)
        states, logits = step(7, caches[1], torch.ones(ids.shape[1] + 1, dtype=torch.long), ids.shape[1], 2)
    torch.testing.assert_close(logits, expected.logits[:, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, expected.hidden_states[-1], atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(caches[1].layers, caches[0].layers):
        assert ours.length == theirs.length
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-5)


@needs_compiler
def test_the_thread_count_does_not_change_a_bit():
    """Each row's dot product is summed in one order whichever thread computes it; PyTorch gets its
    thread count back when the rollout ends."""
    tokenizer, model, rows, spans = make_prompts()
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(one_pass_rollouts(model, tokenizer, rows[2:3], spans[2:3], 12))
            # PyTorch's ops ran on one thread between native steps; its count is back after the rollout
            assert torch.get_num_threads() == count
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert torch.equal(other.rationale_ids, results[0].rationale_ids)
        assert torch.equal(other.token_embeddings, results[0].token_embeddings)


@needs_compiler
def test_the_last_row_of_a_batch_decodes_natively_behind_its_padding(native_calls):
    """Rows that finish leave the batch; the last one left (left padding and a shared prefix in its
    cache, masked) is decoded by the native step and gets what PyTorch's step gives it."""
    tokenizer, model, rows, spans = make_prompts()
    free = one_pass_rollouts(model, tokenizer, rows, spans, 12)
    written = [[t for t in row if t >= 0] for row in free.rationale_ids.tolist()]
    # stop every row but the longest prompt's (index 2) early on a token it writes
    stops = [tokenizer.eos_token_id] + [written[i][1] for i in (0, 1, 3) if written[i][1] not in written[2]]
    native = one_pass_rollouts(model, tokenizer, rows, spans, 12, stops)
    pytorch = one_pass_rollouts(model, tokenizer, rows, spans, 12, stops, options=PYTORCH_STEP)
    _assert_same(native, pytorch)
    assert any(native_calls), "the surviving row never reached the native step"


@needs_compiler
def test_a_lora_policy_decodes_on_its_merged_weight(native_calls):
    tokenizer = make_tokenizer()
    _, _, rows, spans = make_prompts()
    policy = make_lora_model(tokenizer, seed=4)
    native = one_pass_rollouts(policy, tokenizer, rows[:1], spans[:1], 10)
    pytorch = one_pass_rollouts(policy, tokenizer, rows[:1], spans[:1], 10, options=PYTORCH_STEP)
    _assert_same(native, pytorch)
    assert all(native_calls) and native_calls
    # a changed adapter is picked up at the next call, not served from the merged weight of the last
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.mul_(-1)
    _assert_same(
        one_pass_rollouts(policy, tokenizer, rows[:1], spans[:1], 10),
        one_pass_rollouts(policy, tokenizer, rows[:1], spans[:1], 10, options=PYTORCH_STEP),
    )


def test_where_it_does_not_apply_pytorch_s_step_runs(native_calls, monkeypatch):
    """Another pooled layer, bfloat16 weights, another architecture (biases), and no compiler: the step is never
    taken, and the rollout is what it was."""
    tokenizer, model, rows, spans = make_prompts()
    one_pass_rollouts(model, tokenizer, rows[:1], spans[:1], 6, hidden_layer=1)
    assert native_calls == []

    assert NativeStep.for_model(make_model(tokenizer).to(torch.bfloat16)) is None
    biased = make_model(tokenizer)
    biased.config.attention_bias = True
    assert NativeStep.for_model(biased) is None
    model.model.layers[0].mlp.up_proj = torch.nn.Linear(32, 64, bias=True)
    assert NativeStep.for_model(model) is None

    monkeypatch.setattr(native_step, "_library_state", {"function": None})
    tokenizer, model, rows, spans = make_prompts()
    assert NativeStep.for_model(model) is None
    _assert_same(
        one_pass_rollouts(model, tokenizer, rows[:1], spans[:1], 6),
        one_pass_rollouts(model, tokenizer, rows[:1], spans[:1], 6, options=PYTORCH_STEP),
    )
    assert native_calls == []


def test_a_compiler_that_fails_leaves_pytorch_s_step_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("GRACE_ST_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(native_step, "_library_state", {})
    with caplog.at_level(logging.INFO, logger="grace_st.runtime.cpu.native_step"):
        assert native_step.library() is None
    assert "could not be built" in caplog.text
    assert not list(tmp_path.rglob("*.so"))


@needs_compiler
def test_a_cc_with_flags_of_its_own_builds_the_step(monkeypatch, tmp_path):
    """``CC="gcc -O2"`` names a compiler and a flag, as make takes it: the step is built with it,
    not dropped for PyTorch's because no program is called "gcc -O2"."""
    import shutil

    monkeypatch.setenv("GRACE_ST_HOME", str(tmp_path))
    monkeypatch.setenv("CC", f"{shutil.which('cc') or shutil.which('gcc')} -O2")
    monkeypatch.setattr(native_step, "_library_state", {})
    assert native_step.library() is not None
    assert len(list((tmp_path / "kernels").glob("native_step-*.so"))) == 1


@needs_compiler
def test_the_library_is_built_once_into_the_grace_home(monkeypatch, tmp_path):
    monkeypatch.setenv("GRACE_ST_HOME", str(tmp_path))
    monkeypatch.setattr(native_step, "_library_state", {})
    assert native_step.library() is not None
    built = list((tmp_path / "kernels").glob("native_step-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native_step, "_library_state", {})
    assert native_step.library() is not None
    assert built[0].stat().st_mtime_ns == stamp


@needs_compiler
def test_int8_weights_decode_natively_as_the_int8_layers_do(native_calls):
    """grace_st.runtime.cpu.quantization's layers: int8 rows and a scale a row, inputs and outputs rounded to
    bfloat16; the native step does the same arithmetic in another order of sums."""
    from grace_st.runtime.cpu.quantization import quantize_weights

    tokenizer, model, rows, spans = make_prompts()
    quantize_weights(model, "int8")
    for row, span in zip(rows, spans):
        native = one_pass_rollouts(model, tokenizer, [row], [span], 12)
        pytorch = one_pass_rollouts(model, tokenizer, [row], [span], 12, options=PYTORCH_STEP)
        assert torch.equal(native.rationale_ids, pytorch.rationale_ids)
        torch.testing.assert_close(native.token_embeddings, pytorch.token_embeddings, atol=2e-2, rtol=2e-2)
    assert native_calls and all(native_calls)


@needs_compiler
def test_two_threads_decoding_with_one_model_keep_to_their_own_caches():
    """The bound step is shared by a model's callers; each thread fills in its own cache's buffers."""
    import threading

    from grace_st.runtime.decoding import preallocated_cache

    _, model, rows, _ = make_prompts()
    step = NativeStep.for_model(model)
    prompts = [torch.tensor([rows[0]]), torch.tensor([rows[2]])]

    def decode(ids, results, start=None):
        with torch.no_grad():
            cache = preallocated_cache(model, ids.shape[1] + 6)
            model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
            if start is not None:
                start.wait()
            for offset in range(6):
                length = ids.shape[1] + offset
                results.append(step(5 + offset, cache, torch.ones(length + 1, dtype=torch.long), length, 1)[1])

    alone = [[], []]
    for ids, results in zip(prompts, alone):
        decode(ids, results)
    together = [[], []]
    start = threading.Barrier(2)
    threads = [threading.Thread(target=decode, args=(ids, results, start)) for ids, results in zip(prompts, together)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for expected, got in zip(alone, together):
        assert len(got) == 6 and all(torch.equal(a, b) for a, b in zip(expected, got))


@needs_compiler
def test_a_new_cache_that_shares_one_buffer_s_address_with_the_last_is_bound_anew():
    """The allocator can give a new cache the freed keys' address and put its values elsewhere: the
    step must write into the new values, never through the old table into freed memory."""
    from grace_st.runtime.decoding import preallocated_cache

    _, model, rows, _ = make_prompts()
    ids = torch.tensor([rows[2]])
    length = ids.shape[1]
    with torch.no_grad():
        first, second = (preallocated_cache(model, length + 2) for _ in range(2))
        for cache in (first, second):
            model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
        step = NativeStep.for_model(model)
        expected = step(7, first, torch.ones(length + 1, dtype=torch.long), length, 1)[1]
        for old, new in zip(first.layers, second.layers):
            new._keys = old._keys  # the same keys buffer (the same token goes to the same column), new values
        logits = step(7, second, torch.ones(length + 1, dtype=torch.long), length, 1)[1]
    assert torch.equal(logits, expected)
    for old, new in zip(first.layers, second.layers):
        assert new.length == length + 1
        assert torch.equal(new._values[:, :, length], old._values[:, :, length])
        assert new._values[:, :, length].abs().sum() > 0


# -- many rows: decoding steps and the prompt pass ----------------------------------------------------


@needs_compiler
@pytest.mark.parametrize("hidden_size", [32, 64])  # head_dim 8 (plain C attention) and 16 (vector attention)
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_batch_decodes_natively_and_gets_pytorch_s_rationales_and_states(
    hidden_size, do_sample, native_calls, native_prefills
):
    """Four left-padded prompts sharing the instruction prefix: the rest of the prompts and every step
    run natively, and give what PyTorch's prompt pass and steps give."""
    tokenizer, _, rows, spans = make_prompts()
    model = make_model(tokenizer, hidden_size=hidden_size)
    decoding = {"do_sample": do_sample, "seeds": [3, 4, 5, 6] if do_sample else None}
    native = one_pass_rollouts(model, tokenizer, rows, spans, 12, **decoding)
    pytorch = one_pass_rollouts(model, tokenizer, rows, spans, 12, options=PYTORCH_STEP, **decoding)
    _assert_same(native, pytorch)
    assert native_prefills == [True, True] and len(native_calls) >= 11 and all(native_calls)


def _prompt_cache(model, rows):
    """A preallocated cache holding left-padded ``rows`` (PyTorch's pass), its mask, and its room."""
    from grace_st.runtime.batch import left_pad
    from grace_st.runtime.decoding import preallocated_cache

    ids, mask = left_pad(rows, 0)
    cache = preallocated_cache(model, ids.shape[1] + 4)
    with torch.no_grad():
        model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(1) - 1).clamp(min=0),
            **cache_kwargs(model, cache),
            use_cache=True,
        )
    return cache, mask


@needs_compiler
def test_a_row_s_step_does_not_depend_on_the_other_rows_or_the_threads():
    """Every output is one chain of fused multiply-adds, whichever block, thread or batch computes it:
    a row's logits and state are the same bits in a batch of three, alone, and on 1-3 threads."""
    import copy

    tokenizer, _, rows, _ = make_prompts()
    model = make_model(tokenizer, hidden_size=64)
    step = NativeStep.for_model(model)
    cache, mask = _prompt_cache(model, rows[:3])
    tokens = torch.tensor([5, 9, 13])
    step_mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
    positions = step_mask.sum(1) - 1
    with torch.no_grad():
        together = [step(tokens, copy.deepcopy(cache), step_mask, positions, threads) for threads in (1, 2, 3)]
        for row in range(3):
            alone = copy.deepcopy(cache)
            alone.batch_select_indices(torch.tensor([row]))
            states, logits = step(tokens[row : row + 1], alone, step_mask[row : row + 1], positions[row : row + 1], 2)
            for batch_states, batch_logits in together:
                assert torch.equal(batch_logits[row], logits[0])
                assert torch.equal(batch_states[row], states[0])


@needs_compiler
@pytest.mark.parametrize("budget", [4, 0])  # 0: no logits at all (only the shared prefix needs a cache)
def test_the_prompt_pass_skips_padding_and_gives_the_model_s_states_logits_and_cache(budget, native_prefills):
    from grace_st.runtime.batch import left_pad
    from grace_st.runtime.decoding import DecodeOptions, incremental_decoder
    from grace_st.runtime.model_view import ModelView

    tokenizer, _, rows, spans = make_prompts()
    model = make_model(tokenizer, hidden_size=64)
    ids, mask = left_pad(rows, tokenizer.pad_token_id)
    results = []
    for options in (DecodeOptions(), PYTORCH_STEP):
        with torch.no_grad(), incremental_decoder(ModelView(model, options=options)) as decoder:
            states, logits = decoder.prefill(ids, mask, torch.tensor(spans), budget)
            results.append((states, logits, decoder.kv_cache, decoder.mask))
    assert native_prefills == [True, True]  # the shared prefix, then the rest of each prompt
    (states, logits, cache, cache_mask), (expected_states, expected_logits, expected_cache, _) = results
    torch.testing.assert_close(states, expected_states, atol=1e-5, rtol=1e-5)
    if budget:
        torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
    else:
        assert logits is None and expected_logits is None
    assert torch.equal(states[mask == 0], torch.zeros_like(states[mask == 0]))
    for ours, theirs in zip(cache.layers, expected_cache.layers):
        assert ours.length == theirs.length
        real = cache_mask.bool()[:, None, :, None].expand_as(ours.keys)
        # the shared prefix runs natively too: its keys carry float32 rounding like the rest (up to ~1e-5)
        torch.testing.assert_close(ours.keys[real], theirs.keys[real], atol=3e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values[real], theirs.values[real], atol=3e-5, rtol=1e-5)
        assert not ours.keys[~real].any() and not ours.values[~real].any()  # padding: zeros, never computed


@needs_compiler
def test_int8_weights_leave_many_rows_to_pytorch(native_calls, native_prefills):
    from grace_st.runtime.cpu.quantization import quantize_weights

    tokenizer, model, rows, spans = make_prompts()
    quantize_weights(model, "int8")
    cache, _ = _prompt_cache(model, rows[:2])
    assert not NativeStep.for_model(model).applies(cache, 2)
    native = one_pass_rollouts(model, tokenizer, rows, spans, 6)
    pytorch = one_pass_rollouts(model, tokenizer, rows, spans, 6, options=PYTORCH_STEP)
    assert torch.equal(native.rationale_ids, pytorch.rationale_ids)
    assert native_prefills == [] and not any(native_calls[:5])


@needs_compiler
@pytest.mark.skipif(
    "avx512f" not in native_step._cpu_flags(), reason="compares the AVX-512 build with the portable one"
)
def test_the_portable_build_gives_what_the_avx512_build_gives(monkeypatch, tmp_path, native_calls):
    """Built without AVX-512 (as on an AVX2 laptop): the plain-C products, softmax, silu and attention."""
    tokenizer, _, rows, spans = make_prompts()
    model = make_model(tokenizer, hidden_size=64)
    vector = one_pass_rollouts(model, tokenizer, rows, spans, 10)
    monkeypatch.setenv("GRACE_ST_HOME", str(tmp_path))
    monkeypatch.setattr(native_step, "FLAGS", [*native_step.FLAGS, "-mno-avx512f"])
    monkeypatch.setattr(native_step, "_library_state", {})
    portable = one_pass_rollouts(make_model(tokenizer, hidden_size=64), tokenizer, rows, spans, 10)
    assert len(list(tmp_path.rglob("native_step-*.so"))) == 1
    _assert_same(portable, vector)
    assert all(native_calls)


# -- the kernel cache trusts nothing it did not build ---------------------------------------------------

PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *path = getenv("GRACE_TEST_MARKER");
    FILE *marker = path ? fopen(path, "w") : NULL;
    if (marker) { fputs("ran", marker); fclose(marker); }
}
int nothing_here(void) { return 0; }
"""


def _shared_library(source: str, target, tmp_path):
    """``source`` built with the system compiler as the shared library ``target``."""
    import shutil
    import subprocess

    code = tmp_path / "planted.c"
    code.write_text(source)
    subprocess.run(
        [shutil.which("cc") or shutil.which("gcc"), "-shared", "-fPIC", "-o", str(target), str(code)], check=True
    )
    target.chmod(0o755)
    return target


def _record(library):
    """The sha256 record native_step writes beside a library it built, made for ``library``."""
    import hashlib

    record = library.with_name(library.name + ".sha256")
    record.write_text(f"{hashlib.sha256(library.read_bytes()).hexdigest()}  {library.name}\n")
    record.chmod(0o644)
    return record


@pytest.fixture
def kernel_home(monkeypatch, tmp_path):
    """An empty GRACE_ST_HOME, the library not loaded yet, and where a planted constructor would write."""
    home = tmp_path / "home"
    (home / "kernels").mkdir(parents=True, mode=0o700)
    (home / "kernels").chmod(0o700)
    monkeypatch.setenv("GRACE_ST_HOME", str(home))
    monkeypatch.setenv("GRACE_TEST_MARKER", str(tmp_path / "marker"))
    monkeypatch.setattr(native_step, "_library_state", {})
    kernels = home / "kernels"
    return kernels, kernels / native_step.library_name(native_step._compiler()), tmp_path / "marker"


def _planted(kernels, name, tmp_path, how):
    library = _shared_library(PLANTED, kernels / name, tmp_path)
    if how != "no-record":
        _record(library)  # a record that matches: the owner and mode checks must refuse it on their own
    if how == "world-writable":
        library.chmod(0o777)
    if how == "foreign-owner":
        import os

        if os.getuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(library, 65534, 65534)
    return library


@needs_compiler
@pytest.mark.parametrize("how", ["no-record", "world-writable", "foreign-owner"])
def test_a_planted_library_is_not_loaded(kernel_home, tmp_path, how):
    kernels, target, marker = kernel_home
    _planted(kernels, target.name, tmp_path, how)
    with pytest.warns(RuntimeWarning, match=str(target)):
        assert native_step.library() is not None  # built again, in its own folder
    assert not marker.exists()
    assert target.stat().st_uid == __import__("os").getuid() and target.stat().st_mode & 0o022 == 0


@needs_compiler
def test_a_group_writable_cache_folder_is_refused(kernel_home, tmp_path):
    """Anyone in the group could have put the library there, or could swap it later: not loaded, not
    written to; the step is built in a private folder for this process instead."""
    kernels, target, marker = kernel_home
    _record(_planted(kernels, target.name, tmp_path, "recorded"))
    kernels.chmod(0o775)
    before = sorted(p.name for p in kernels.iterdir())
    with pytest.warns(RuntimeWarning, match=f"{kernels}.*group- or world-writable"):
        assert native_step.library() is not None
    assert not marker.exists()
    assert sorted(p.name for p in kernels.iterdir()) == before


@needs_compiler
def test_a_truncated_cached_library_is_built_again(kernel_home):
    """A truncated library would die in dlopen or at its first call (SIGBUS): its sha256 no longer
    matches its record, so it is never loaded, and the step is built again."""
    _, target, _ = kernel_home
    assert native_step.library() is not None
    # a new file in its place, as a crash or a full disk leaves one: truncating the loaded file itself would pull
    # the pages from under this process's own mapping of it
    truncated = target.with_name(target.name + ".truncated")
    truncated.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    os.replace(truncated, target)
    native_step._library_state.clear()
    with pytest.warns(RuntimeWarning, match=f"{target}.*sha256"):
        assert native_step.library() is not None
    native_step._library_state.clear()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native_step.library() is not None  # the rebuilt one passes its checks


@needs_compiler
def test_a_library_without_the_step_s_symbol_falls_back_with_one_warning(kernel_home, tmp_path, caplog):
    """Our own file, recorded, but not the step's library: PyTorch's step runs, with one warning."""
    _, target, _ = kernel_home
    _record(_shared_library("int nothing_here(void) { return 0; }\n", target, tmp_path))
    with pytest.warns(RuntimeWarning, match=f"{target}.*grace_native_step") as caught:
        assert native_step.library() is None
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    tokenizer, model, rows, spans = make_prompts()
    native = one_pass_rollouts(model, tokenizer, rows[:1], spans[:1], 4)  # decodes, on PyTorch's step
    assert native.rationale_ids.shape[0] == 1


# -- the contract between native_step.c and its ctypes mirror ----------------------------------------------

POINTER = ctypes.sizeof(ctypes.c_void_p)  # an int inserted before a pointer takes a pointer's room, padding included
LAYER, Q = ctypes.sizeof(native_step._Layer), native_step._Layer.q.offset
CONTRACT_BREAKS = {
    # every field after the inserted one moves, and the struct grows
    "a field inserted into Layer": (
        "    Matrix q, k, v, o, gate, up, down;\n",
        "    int extra;\n    Matrix q, k, v, o, gate, up, down;\n",
        [
            f"struct Layer is {LAYER + POINTER} bytes in the library, {LAYER} in ctypes",
            f"Layer field 'q' at offset {Q + POINTER} in the library, {Q} in ctypes",
        ],
    ),
    # the same size: only the offsets tell
    "Matrix's fields swapped": (
        "    const void *weight;\n    const float *scale;\n} Matrix;",
        "    const float *scale;\n    const void *weight;\n} Matrix;",
        [f"Matrix field 'weight' at offset {POINTER} in the library, 0 in ctypes"],
    ),
    "a parameter added to the step": (
        "float *logits_out, int threads\n",
        "float *logits_out, int threads, int spare\n",
        ["grace_native_step takes 27 arguments in the library, 26 in ctypes"],
    ),
}


@pytest.mark.skipif(native_step._compiler() is None or platform.system() == "Windows", reason="no C compiler")
def test_the_shipped_library_keeps_the_contract(tmp_path):
    """Built as library() builds it, and loaded directly: not under needs_compiler, since a shipped library
    its own check refused would make library() None and every other test here skip instead of fail."""
    target = tmp_path / "native_step.so"
    native_step._compile(native_step._compiler(), target)
    built = ctypes.CDLL(str(target))
    assert native_step.contract_mismatches(built) == []
    assert built.grace_step_arg_count() == len(native_step.STEP_ARGTYPES)


@needs_compiler
@pytest.mark.parametrize("change", sorted(CONTRACT_BREAKS))
def test_a_library_that_breaks_the_contract_is_never_called(change, kernel_home, tmp_path, monkeypatch, native_calls):
    """A source whose structs or step parameters no longer match the ctypes mirror: built (a cache entry of its
    own, the shipped library's untouched), refused with one warning naming the mismatch, and PyTorch's step runs."""
    kernels, shipped, _ = kernel_home
    old, new, expected = CONTRACT_BREAKS[change]
    source = native_step.SOURCE.read_text()
    assert source.count(old) == 1
    changed = tmp_path / "native_step.c"
    changed.write_text(source.replace(old, new))
    monkeypatch.setattr(native_step, "SOURCE", changed)
    with pytest.warns(RuntimeWarning, match="native kernel contract mismatch") as caught:
        assert native_step.library() is None
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    for part in expected:
        assert part in messages[0]
    built = native_step.library_name(native_step._compiler())
    assert built != shipped.name and [p.name for p in kernels.glob("*.so")] == [built]

    tokenizer, model, rows, spans = make_prompts()
    assert NativeStep.for_model(model) is None
    _assert_same(
        one_pass_rollouts(model, tokenizer, rows[:1], spans[:1], 4),
        one_pass_rollouts(model, tokenizer, rows[:1], spans[:1], 4, options=PYTORCH_STEP),
    )
    assert native_calls == []
