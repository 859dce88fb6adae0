"""The eager machinery: how an aten op on tpu tensors runs.

``core.dispatch`` is the body of ``TPUTensor.__torch_dispatch__``. Importing this
package imports nothing (``modes`` is needed by ``import torchtpu``, which must not
import JAX); its modules do. See docs/architecture.md for the path of one op.
"""
