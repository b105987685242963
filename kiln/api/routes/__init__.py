"""The HTTP routes, one file per endpoint family; api/server.py lists them."""
