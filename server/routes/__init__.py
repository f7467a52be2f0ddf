"""HTTP route handlers, one module per concern."""
