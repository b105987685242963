"""One module per model family (config and tensor names), and the one forward they share."""
