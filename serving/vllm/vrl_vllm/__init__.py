"""vLLM plugin for vrl's exported models: registers `VrlForCausalLM` (vrl_vllm/model.py) with vLLM's
model registry. vLLM calls `register` in every process it starts (the `vllm.general_plugins` entry
point in pyproject.toml), so `vllm serve DIR` and `LLM(model=DIR)` load a vrl export once this
package is installed."""

ARCHITECTURE = 'VrlForCausalLM'


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, 'vrl_vllm.model:VrlForCausalLM')
