"""The `d9d` console script."""
