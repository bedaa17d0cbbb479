"""The model: its shapes and config, the naive forward (the definition of correct), the one layer, load-time
transforms and the runner that executes a batch on the paged cache (lessons 01, 06)."""
