"""One module per model architecture, built from runtime/layers.py."""
