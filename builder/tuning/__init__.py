"""trtbuild tune: the serving-settings search on a real Triton, one module per job (see README, Architecture)."""
