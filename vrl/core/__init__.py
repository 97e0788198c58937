"""What every wing shares: the config schema (config), errors, paths that may be remote (storage),
the mesh and logical-axis sharding rules (sharding), multi-host coordination, backend set-up and the
command-line plumbing (cli). Imports nothing else of vrl."""
