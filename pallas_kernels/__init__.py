"""GPU kernels, each beside its plain-jnp reference and a dispatch that picks the kernel on GPU."""
