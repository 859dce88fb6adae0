"""Entry point of torch's ``torch.backends`` group: ``import torch`` alone registers
the tpu device.

It lives apart from ``torchtpu/__init__`` because ``import torchtpu`` imports torch,
which runs this entry point while torchtpu is still half-imported; importing the
package here is then a no-op and torchtpu registers the device when it finishes.
"""


def load() -> None:
    try:
        import torchtpu  # noqa: F401  (importing it registers the device)
    except Exception as exc:
        # torch raises out of ``import torch`` when an entry point fails: a torch release
        # torchtpu cannot register with must not cost the user torch itself.
        import warnings

        import torch

        warnings.warn(
            f"torchtpu could not register the tpu device on torch {torch.__version__} "
            f"({type(exc).__name__}: {exc}); torch works without it",
            RuntimeWarning,
            stacklevel=2,
        )
