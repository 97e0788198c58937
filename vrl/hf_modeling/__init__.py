"""The PyTorch model and config that vrl.export writes next to the weights of a model that is not a plain Llama."""
