"""The data: raw input files read (sources), datasets built from them on many processes (build) and
read (corpus), tokenizers, pre-tokenized shards (shards: their files; tokens: finding and making
them), the grain pipeline; commands `python -m vrl.data` and `python -m vrl.data.tokenizer`.
Imports vrl.core only."""
