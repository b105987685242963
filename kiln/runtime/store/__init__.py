"""Model files: the catalogue, pulling from PyPI, reading GGUF files."""
