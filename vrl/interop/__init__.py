"""The Hugging Face formats: vrl parameters and tokenizers to and from safetensors, config.json and
tokenizer files (hf), and the PyTorch model written into exports (hf_modeling).
Imports vrl.core, vrl.model and vrl.data."""
