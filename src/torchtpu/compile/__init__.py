"""The compiled paths: ``torch.compile(model, backend="tpu")`` (backend.py) and
`torchtpu.jit` (jit.py). Both turn torch code into one jitted XLA program per input
signature by running it through the eager dispatcher on JAX tracers (program.py,
tracing.py), so they share the eager lowering table.

Importing this package imports neither Dynamo nor JAX; its modules do.
"""
