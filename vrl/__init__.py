"""vrl: pretraining Llama-style decoders with value residual learning (vanilla, ResFormer, SVFormer)."""
