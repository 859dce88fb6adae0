"""Entry point of torch's ``torch.backends`` group: ``import torch`` alone registers
the tpu device.

It lives apart from ``torchtpu/__init__`` because ``import torchtpu`` imports torch,
which runs this entry point while torchtpu is still half-imported; importing the
package here is then a no-op and torchtpu registers the device when it finishes.
"""


def load() -> None:
    import torchtpu  # noqa: F401  (importing it registers the device)
