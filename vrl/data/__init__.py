"""The data: its config, raw files read (sources) and built into datasets on many processes (build),
datasets read (corpus), tokenizers, pre-tokenized shards (shards, tokens), the grain pipeline; commands
`python -m vrl.data` and `python -m vrl.data.tokenizer`. Imports vrl.core only."""
