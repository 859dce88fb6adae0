"""``out=`` forms of factories: ``torch.rand(3, out=o)``, ``torch.randperm(5, out=p)``.

The factory makes the values on ``o``'s device, ``o`` is resized to their size as
torch's kernel resizes it, and they are copied in: ``out=`` draws what the factory
itself draws, as on the CPU.
"""

from __future__ import annotations

import torch

from torchtpu.dispatch import out_tensors, schema

aten = torch.ops.aten


# Sequences whose CPU out= kernels resize the out tensor only where its number of
# elements differs (silently), and otherwise fill it as it is: in its own shape, through
# its strides (``arange(4, out=x.narrow(1, 1, 2))`` fills a 2x2 view; issue #31).
SEQUENCES = frozenset({"aten::arange", "aten::range", "aten::linspace", "aten::logspace"})


def handler(info, factory):
    """The handler of the ``out=`` op ``info.op``, filled by ``factory``
    (`schema.factory_variant`)."""
    sequence = info.op._schema.name in SEQUENCES
    factory_info = schema.info(factory)
    # torch's hand-written kernels (rand, randint, randperm, zeros) fill the out tensor
    # in its own dtype after ``out.resize_(size)``: silently, whatever it held. A factory
    # "like" another tensor (rand_like, new_zeros) has a generated out= kernel: it computes
    # in that tensor's dtype, then resizes with resize_output's warning and casts.
    like_self = any(a.name == "self" for a in factory_info.args)

    def factory_then_copy(func, args, kwargs):
        values = info.bind(args, kwargs)
        out = values[info.out_args[0]]
        given = {a.name: v for a, v in zip(info.args, values)}
        given["device"] = out.device
        if not like_self:
            given["dtype"] = out.dtype
        fargs, fkwargs = factory_info.split(
            [given.get(a.name, a.default) for a in factory_info.args]
        )
        # Called through torch, not the dispatcher: a factory without tensor arguments
        # (rand) reaches tpu through its PrivateUse1 kernel, as torch.rand(device="tpu").
        result = factory(*fargs, **fkwargs)
        if sequence and out.numel() == result.numel():
            return out.copy_(result.reshape(out.shape))
        if like_self:
            out_tensors.fit(info, out, result)
        elif out.shape != result.shape:
            aten.resize_.default(out, result.shape)
        return out.copy_(result)

    return factory_then_copy
