"""One warm executor on one device: ``core`` (functions, models, templates, engine),
``app`` (the internal HTTP API), ``main`` (the process entry point). Importing this package
imports nothing heavy; ``app`` needs no torch, so the gateway can share its constants."""
