"""kiln's HTTP server and command line."""
