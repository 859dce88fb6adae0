"""JAX interop: tpu tensors to and from jax arrays (arrays.py), JAX functions and
Pallas kernels as torch ops (functions.py, pallas.py). See docs/jax-interop.md."""
