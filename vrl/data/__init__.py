"""The data: corpora into TFDS datasets (corpus), tokenizers, pre-tokenized shards (tokens), the grain
pipeline; commands `python -m vrl.data` and `python -m vrl.data.tokenizer`.
Imports vrl.core only."""
