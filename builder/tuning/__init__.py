"""trtbuild tune: the serving-settings search on a real Triton, one module per job (see docs/architecture.md)."""
