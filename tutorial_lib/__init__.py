Low-precision FSDP2 tutorial library.
