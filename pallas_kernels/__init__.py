"""GPU kernels, each beside its plain-jnp reference and a dispatch that picks the kernel on GPU for the
caller's KernelPolicy (policy.py). Nothing here imports the model or the engine."""
