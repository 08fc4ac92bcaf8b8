"""Module paths that moved into the layer folders, kept importable for one release.

``import grace_st.engine`` (or ``python -m grace_training.export_adapter``) still works and warns once with the
new path: the finder below answers for the old name with the new module itself, so there is one module object and
no copy to drift. A table rather than a stub file per old path keeps the tree showing only the layers.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "grace_st.adapter": "grace_st.files.adapter",
    "grace_st.batch": "grace_st.runtime.batch",
    "grace_st.build": "grace_st.from_causal_lm",
    "grace_st.decoding": "grace_st.runtime.decoding",
    "grace_st.encoder_files": "grace_st.files.model_files",
    "grace_st.encoder_inputs": "grace_st.encoding",
    "grace_st.encoder_outputs": "grace_st.encoding",
    "grace_st.engine": "grace_st.methods",
    "grace_st.generation": "grace_st.runtime.generation",
    "grace_st.grc": "grace_st.methods.grc",
    "grace_st.home": "grace_st.runtime.home",
    "grace_st.hub": "grace_st.files.hub",
    "grace_st.loading": "grace_st.files.loading",
    "grace_st.mteb_identity": "grace_st.files.mteb_identity",
    "grace_st.native_step": "grace_st.runtime.cpu.native_step",
    "grace_st.packed_linear": "grace_st.runtime.cpu.packed_linear",
    "grace_st.quantization": "grace_st.runtime.cpu.quantization",
    "grace_st.scheduler": "grace_st.serve.scheduler",
    "grace_st.second_pass": "grace_st.runtime.second_pass",
    "grace_st.server": "grace_st.serve.server",
    "grace_st.soft_tokens": "grace_st.methods.gircse",
    "grace_st.transformers_compat": "grace_st.runtime.transformers_compat",
    "grace_st.vllm_backend": "grace_st.runtime.vllm_backend",
    "grace_st.weights": "grace_st.runtime.weights",
    "grace_training.average_adapters": "grace_training.tools.average_adapters",
    "grace_training.checkpoint": "grace_training.run.checkpoint",
    "grace_training.contrastive": "grace_training.algorithms.infonce.train",
    "grace_training.export_adapter": "grace_training.tools.export_adapter",
    "grace_training.gircse": "grace_training.algorithms.icr.loss",
    "grace_training.grc": "grace_training.algorithms.grc.loss",
    "grace_training.grc_step": "grace_training.algorithms.grc.step",
    "grace_training.grpo": "grace_training.algorithms.grpo.loss",
    "grace_training.grpo_step": "grace_training.algorithms.grpo.step",
    "grace_training.hub": "grace_training.run.hub",
    "grace_training.hybrid": "grace_training.algorithms.grpo.hybrid",
    "grace_training.icr_step": "grace_training.algorithms.icr.step",
    "grace_training.interpolate_weights": "grace_training.tools.interpolate_weights",
    "grace_training.lowrank_adapter": "grace_training.tools.lowrank_adapter",
    "grace_training.metrics": "grace_training.run.metrics",
    "grace_training.mining": "grace_training.data.mining",
    "grace_training.output_dirs": "grace_training.config.output_dirs",
    "grace_training.processes": "grace_training.run.processes",
    "grace_training.rewards": "grace_training.algorithms.grpo.rewards",
    "grace_training.rollout": "grace_training.algorithms.grpo.rollout",
    "grace_training.rollout_batch": "grace_training.algorithms.grpo.rollout_batch",
    "grace_training.run_dir": "grace_training.run.run_dir",
    "grace_training.sampling": "grace_training.data.sampling",
    "grace_training.validation": "grace_training.config.validation",
    "grace_training.vllm_backend": "grace_training.algorithms.grpo.vllm_backend",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old module path with the module at its new one (and ``python -m`` with its code)."""

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        # the new module's file as the origin: ``python -m`` sets ``__file__`` from it
        return importlib.util.spec_from_loader(name, self, origin=importlib.util.find_spec(MOVED[name]).origin)

    def create_module(self, spec):
        warnings.warn(
            f"{spec.name} moved to {MOVED[spec.name]}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        """The new module ran when it was imported: nothing left to run."""

    def get_code(self, name):
        return importlib.util.find_spec(MOVED[name]).loader.get_code(MOVED[name])

    def is_package(self, name):
        return False


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
