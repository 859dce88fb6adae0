"""A compiled loss of upcast logits computes from the 16-bit logits.

Note [A compiled loss of upcast logits]
    Language models take the loss of their logits cast to float32
    (``F.cross_entropy(logits.float(), target)``: Transformers' ``ForCausalLMLoss``,
    TorchTitan, benchmarks/gpt.py). Traced as written, the backward reads the cast's
    float32 [tokens, vocabulary] result or ``log_softmax``'s, and AOTAutograd's
    partition keeps one between the forward's program and the backward's: 1.5 GiB at
    GPT-2 small's 8x1024 tokens, beside the 16-bit logits. Eagerly the loss keeps the
    16-bit logits instead (Note [Saving the logits' values], dispatch/saved_values.py).
    In a graph the float32 copy is the loss's alone when nothing else reads it, so
    `rewrite` has the loss computed from the 16-bit logits in float32 -- torchtpu's
    cross-entropy op with ``dtype=float32``, which autocast's loss uses -- and its
    gradient cast back to the logits' dtype, as the cast's backward would: the same
    numbers, and the backward keeps the 16-bit logits and a float per row.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

_SIGNATURE = inspect.signature(F.cross_entropy)
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def rewrite(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Dynamo's graph with each ``cross_entropy`` of a 16-bit tensor's float32 copy
    that nothing else reads computed from the 16-bit tensor (in place)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not F.cross_entropy:
            continue
        found = _upcast_loss(node)
        if found is None:
            continue
        cast, logits, arguments = found
        narrow = cast.args[0]
        cast.replace_all_uses_with(narrow)  # views between take the 16-bit tensor
        gm.graph.erase_node(cast)
        logits = narrow if logits is cast else logits
        with gm.graph.inserting_before(node):
            loss = gm.graph.call_function(upcast_cross_entropy, (logits, *arguments))
        loss.meta.update(node.meta)
        node.replace_all_uses_with(loss)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return gm


def upcast_cross_entropy(logits, target, reduction: int, ignore_index: int, smoothing: float):
    """``F.cross_entropy(logits.float(), target, ...)`` for 16-bit [N, C] ``logits``."""
    from torchtpu.ops.cross_entropy import CrossEntropy

    return CrossEntropy.apply(
        logits, target, None, reduction, ignore_index, smoothing, torch.float32
    )


def _upcast_loss(node: torch.fx.Node):
    """(the cast, the loss's input once the cast is gone, the op's other arguments)
    where ``node`` is the loss of class indices, without weights, of a float32 copy
    (or a view of one: ``logits.float().view(-1, vocabulary)``, as Transformers' loss)
    that only it reads; else None."""
    try:
        bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    given = bound.arguments
    logits, target = given["input"], given["target"]
    cast = logits
    while _is_view(cast) and len(cast.users) == 1:
        cast = cast.args[0]
    if not (_is_float32_cast(cast) and len(cast.users) == 1):
        return None
    narrow = _value(cast.args[0]) if isinstance(cast.args[0], torch.fx.Node) else None
    if narrow is None or narrow.dtype not in (torch.bfloat16, torch.float16):
        return None
    if not (
        given["weight"] is None
        and given["size_average"] is None
        and given["reduce"] is None
        and given["reduction"] in _REDUCTIONS
        and type(given["ignore_index"]) is int
        and type(given["label_smoothing"]) in (int, float)
        and 0.0 <= given["label_smoothing"] <= 1.0
        and isinstance(logits, torch.fx.Node)
        and isinstance(target, torch.fx.Node)
    ):
        return None
    x, t = _value(logits), _value(target)
    if not (
        x is not None
        and t is not None
        and x.device.type == "tpu"
        and t.device == x.device
        and x.dim() == 2
        and t.dtype == torch.int64
        and t.dim() == 1
        and statically_known_true(t.shape[0] == x.shape[0])
    ):
        return None
    arguments = (
        target,
        _REDUCTIONS[given["reduction"]],
        given["ignore_index"],
        float(given["label_smoothing"]),
    )
    return cast, logits, arguments


def _is_float32_cast(node) -> bool:
    """Whether ``node`` is ``x.float()`` or ``x.to(torch.float32)``."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_method":
        return False
    if node.target == "float":
        return len(node.args) == 1 and not node.kwargs
    if node.target == "to":
        dtype = node.args[1:] or tuple(node.kwargs.values())
        return len(node.args) <= 2 and dtype == (torch.float32,) and set(node.kwargs) <= {"dtype"}
    return False


# Views Transformers and TorchTitan take of the logits before their loss; each keeps
# the dtype, so the view of the 16-bit tensor is the 16-bit view of the copy.
_VIEWS = {"view", "reshape", "flatten", "contiguous"}


def _is_view(node) -> bool:
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "call_method"
        and node.target in _VIEWS
        and not any(isinstance(a, torch.dtype) for a in (*node.args, *node.kwargs.values()))
    )


def _value(node: torch.fx.Node):
    value = node.meta.get("example_value")
    return value if isinstance(value, torch.Tensor) else None
