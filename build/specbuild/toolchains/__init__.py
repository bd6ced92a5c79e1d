"""One module per toolchain."""
