"""What a trained run is used for: sampling text (generate), lm-evaluation-harness (evaluate) and the
Hugging Face export; each a command, `python -m vrl.tools.<name>`.
Imports any wing below: core, model, data, interop, train."""
