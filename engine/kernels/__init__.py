"""Expert kernels, one module per device family and record kind."""
