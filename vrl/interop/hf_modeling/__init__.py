"""The PyTorch model and config that vrl.tools.export writes next to the weights of a model that is not a plain
Llama."""
