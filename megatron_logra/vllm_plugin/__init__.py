"""megatron_logra's vLLM plugin: keeps a live vLLM engine in step with the trainer by low-rank
policy sync (docs/vllm.md).

* :mod:`.layout`: Megatron's full (TP=1) tensors -> Hugging Face names (what vLLM's loaders take),
  and vLLM's TP shards -> Hugging Face tensors (for the weight check); torch only;
* :mod:`.extension`: the worker extension (``worker_extension_cls``) holding the exact shadow and
  writing the served weights;
* :mod:`.server`: the engine process the trainer's ``VLLMEngine`` client talks to.

:func:`register` is vLLM's general-plugin entry point; vLLM calls it in every process it starts
(the engine core and each worker) before the model is built.
"""

from __future__ import annotations

VLLM_VERSION = "0.32.0"
"""The vLLM release this plugin is written and tested against (it patches one CPU function)."""


def register() -> None:
    """Make CPU vLLM's linear layers compute with plain ``F.linear`` on their weight tensors.

    Stock CPU vLLM repacks each linear weight into a oneDNN (or SGL) handle after loading and
    empties ``layer.weight``: a weight written afterwards would be invisible to the forward
    pass, so no in-place update could reach the served model. With ``F.linear`` (what GPU vLLM
    does) the weights stay ordinary tensors and a sync writes them in place, through vLLM's own
    weight loaders. Only the CPU dispatch is replaced; other platforms are untouched.
    """
    import torch
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or getattr(utils, "_megatron_logra_patched", False):
        return
    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch_plain_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:
            original(layer, remove_weight)  # conv / MoE weights: not ours to change
            return
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = dispatch_plain_linear
    utils._megatron_logra_patched = True
