"""One entry point for every strategy: the Engine protocol, `setup`, the registry, the adapters."""
