"""The Triton model repository: staged, all-or-nothing commits; config.pbtxt through Triton's schema;
the python-backend runner; each model folder's build record."""
