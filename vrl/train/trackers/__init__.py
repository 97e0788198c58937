"""Where a run's records go: metrics.jsonl, TensorBoard, Weights & Biases and the terminal, each a
`Tracker` (tracker.py) in a file of its own, written to together through `Trackers`
(composite.py), which also keeps an object-store workdir's files on the store (stored.py)."""
