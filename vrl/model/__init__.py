"""The model: its config, math and modules (ops, attention kernels, the decoder and its variants,
parameters), per-platform choices of the autos (resolve), per-layer statistics, parameter and FLOP
accounting, the KV cache and decoding. Imports vrl.core only."""
