"""What every wing shares: the config schema's machinery (config; each wing owns its section), errors,
paths that may be remote (storage), the mesh, its config and the logical-axis sharding rules (sharding),
multi-host coordination, backend set-up and the command-line plumbing (cli). Imports nothing else of vrl."""
