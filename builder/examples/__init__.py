"""The packaged example models (EfficientNet-Lite0, all-MiniLM-L6-v2) and their real sample data."""
