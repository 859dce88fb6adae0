"""FlexAttention on tpu tensors: torch's higher-order ops, run as any other tpu code.

``torch.nn.attention.flex_attention.flex_attention(q, k, v, score_mod=, block_mask=)``
always goes through Dynamo, even in eager mode (with its "eager" backend): Dynamo
captures ``score_mod`` and the block mask's ``mask_mod`` as FX graphs and calls the
higher-order op ``flex_attention`` (and, in backward, ``flex_attention_backward``) with
them. torch gives those ops a kernel per dispatch key and per mode, and a tensor
subclass its own entry (``py_impl(TPUTensor)``), registered here:

- on traced wrappers (Dynamo and AOTAutograd tracing a model on tpu, handles.py) the
  op runs on their inner tensors, so the graph holds the higher-order op itself with
  its score_mod and mask_mod graphs, as on CUDA;
- on tpu tensors it scores only the blocks the block mask lists (flex_blocks.py; in a
  trace, where their number is a value of the program, by a loop over them,
  flex_loop.py), or runs torch's own dense implementation (``sdpa_dense`` and
  ``sdpa_dense_backward``) where they would not pay: score_mod and mask_mod
  applied to the whole [B, H, L, S] score matrix through ``vmap``, in float32
  (float64 for float64 inputs), then a softmax that gives fully masked rows zeros.
  Either is ordinary tpu ops: in Strict each runs as its program, in DeferAndFuse
  they join the chunk, and inside a compiled graph or `torchtpu.jit` step they are
  traced into its one XLA program.

Autograd is torch's (``FlexAttentionAutogradOp``): score_mod's gradient graph is traced
on fake tpu tensors (Note [Tpu tensors among fake tensors] in tensor.py), and gradients
reach q, k, v and the tensors score_mod captures (a learned bias).

Note [A compiled flex_attention alone runs eagerly]
    Transformers and TorchTitan call ``torch.compile(flex_attention)`` (the function
    alone) and use it for every layer. Traced, such a graph loops over its block
    mask's lists where the keys span enough blocks (flex_loop.py); on a TPU v5e that
    loop takes 6.7 ms for a sliding window over 8k keys, forward and backward, where
    the same blocks scored eagerly take 54 ms in Strict (launch-bound: ops of their
    own). Over fewer blocks a trace would score every key; eagerly, the listed blocks
    are scored where they hold at most half of the scores. So the backend traces a
    lone call that would loop and runs the others as they are, on tpu tensors, as
    torch runs flex_attention outside torch.compile (there it compiles itself with
    Dynamo's "eager" backend): in Strict as ops of their own, in DeferAndFuse as part
    of the chunk; torch's autograd of the op takes the gradients. A model compiled
    whole, with flex_attention inside, is always traced.

Note [score_mod's gradient graphs, made once]
    Called eagerly with inputs that require gradients, FlexAttention's autograd traces
    score_mod's forward and joint graphs (``create_fw_bw_graph``: ``make_fx`` over
    scalars) at every call: 12 ms of the host's time a call on a TPU v5e's host, where
    the splash kernel's forward and backward take a few ms, and again for every layer.
    The graphs depend on score_mod, the scalars' dtypes and the captured tensors'
    shapes, strides and dtypes only, so for tpu inputs they are kept per score_mod and
    reused where those match. Only for a score_mod that is a GraphModule: flex_attention
    hands the op the graph Dynamo made of the user's function, and Dynamo makes a new
    one where the function's code or the values it closes over change (its guards),
    so one graph object always computes the same thing.
"""

from __future__ import annotations

import importlib
import operator
import weakref

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from torchtpu import _compat, tracing
from torchtpu.compile import flex_blocks, handles
from torchtpu.tensor import TPUTensor

# The module, not the op: ``torch._higher_order_ops.flex_attention`` is also the name of
# the op that package exports.
_hop = importlib.import_module("torch._higher_order_ops.flex_attention")


def _traced(args, kwargs) -> bool:
    return any(type(t) is TPUTensor and t._inner is not None for t in tree_leaves((args, kwargs)))


def _on_tpu(op, dense):
    """``op``'s kernel for TPUTensor arguments; ``dense`` is torch's implementation."""

    def kernel(*args, **kwargs):
        if _traced(args, kwargs):
            inner_args, inner_kwargs = tree_map_only(TPUTensor, lambda t: t._inner, (args, kwargs))
            out = op(*inner_args, **inner_kwargs)
            return tree_map_only(torch.Tensor, handles.wrap_traced, out)
        return dense(*args, **kwargs)

    _compat.register_higher_order_kernel(op, TPUTensor, kernel)


def _dense_backward(*args):
    """torch's dense backward, with the gradient of every tensor score_mod captured
    whose gradient score_mod's joint graph computes, when it runs in a trace.

    torch's dense backward leaves out the gradient of a captured tensor that does not
    require one, and the tensors a trace runs on never require gradients; but the
    program traced (a compiled graph, whose shape the fake kernel set, or a
    torchtpu.jit step) needs those its joint graph was made for."""
    if tracing.active() is None:
        return _hop.sdpa_dense_backward(*args)
    *head, buffers, mask_buffers = args
    joint_graph = head[8]
    wanted = flex_blocks.gradients_computed(joint_graph, len(buffers))
    buffers = tuple(
        b.detach().requires_grad_() if want and isinstance(b, torch.Tensor) else b
        for b, want in zip(buffers, wanted)
    )
    with torch.no_grad():
        return _hop.sdpa_dense_backward(*head, buffers, mask_buffers)


# What a graph that is one flex_attention call holds besides the call: its outputs taken
# apart and the log-sum-exp scaled to base e (torch's ``_finalize_outputs``).
_AROUND_A_LONE_CALL = frozenset({operator.getitem, operator.mul, torch.mul})


def runs_eagerly(gm: torch.fx.GraphModule) -> bool:
    """Whether a Dynamo graph is one flex_attention call, as ``torch.compile(
    flex_attention)`` makes it, that traced would not loop over its block mask's lists
    (Note [A compiled flex_attention alone runs eagerly])."""
    if not is_a_lone_call(gm):
        return False
    call = next(n for n in gm.graph.nodes if n.target is _hop.flex_attention)
    query, key, block_mask = call.args[0], call.args[1], call.args[4]
    query, key = (n.meta.get("example_value") for n in (query, key))
    kv_block = block_mask[-2] if isinstance(block_mask, tuple) else None
    if query is None or key is None or type(kv_block) is not int:
        return True
    kv_length = key.shape[-2]
    return type(kv_length) is not int or not flex_blocks.loops_when_traced(kv_block, kv_length, query.dtype)


def is_a_lone_call(gm: torch.fx.GraphModule) -> bool:
    """Whether a Dynamo graph is one flex_attention call, as ``torch.compile(
    flex_attention)`` makes it (Note [A compiled flex_attention alone runs eagerly])."""
    # Methods (``q.clone()``) and modules count as calls too: only the call itself and
    # the handling of its outputs may be there.
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    return sum(n.target is _hop.flex_attention for n in calls) == 1 and all(
        n.op == "call_function" and (n.target is _hop.flex_attention or n.target in _AROUND_A_LONE_CALL)
        for n in calls
    )


def _backward(*args):
    return flex_blocks.backward(*args, dense=_dense_backward)


OPS = (_hop.flex_attention, _hop.flex_attention_backward)
_on_tpu(_hop.flex_attention, flex_blocks.forward)
_on_tpu(_hop.flex_attention_backward, _backward)


def _check_device(query, key, value):
    """flex_attention's device check, which passes tpu tensors. Dynamo inlines it
    (compile/backend.py), so a compiled model calling flex_attention has no break.

    Called eagerly, flex_attention compiles itself with Dynamo, which after a second
    shape makes sizes symbolic; on tpu tensors (views of another shape, as attention's
    heads are) that failed making its guards (IndexError in symbolic_shapes). A new
    shape runs a new program on tpu anyway, so q, k and v are static to it."""
    if query.device.type != "tpu":
        _torchs_device_check(query, key, value)
    elif not torch.compiler.is_compiling():
        for t in (query, key, value):
            torch._dynamo.mark_static(t)


_torchs_device_check = _compat.replace_flex_attention_device_check(_check_device)


# score_mod's id -> (a weak reference to it, what its graphs were made for, the graphs).
_gradient_graphs: dict[int, tuple] = {}


def _graphs_made_once(make):
    """torch's ``create_fw_bw_graph``, kept per score_mod for eager tpu inputs (Note
    [score_mod's gradient graphs, made once]); as it was for anything else (a trace
    makes its graphs once anyway)."""

    def create_fw_bw_graph(score_mod, index_values, other_buffers):
        example = index_values[0]
        if not (
            isinstance(score_mod, torch.fx.GraphModule)
            and type(example) is TPUTensor
            and example._inner is None  # a tpu tensor, not a traced wrapper
        ):
            return make(score_mod, index_values, other_buffers)
        made_for = (
            tuple((v.dtype, v.requires_grad) for v in index_values),
            tuple(
                (b.shape, b.stride(), b.dtype, b.requires_grad)
                if isinstance(b, torch.Tensor)
                else (type(b), b)
                for b in other_buffers
            ),
        )
        key = id(score_mod)
        cached = _gradient_graphs.get(key)
        if cached is not None and cached[0]() is score_mod and cached[1] == made_for:
            return cached[2]
        graphs = make(score_mod, index_values, other_buffers)
        ref = weakref.ref(score_mod, lambda _: _gradient_graphs.pop(key, None))
        _gradient_graphs[key] = (ref, made_for, graphs)
        return graphs

    return create_fw_bw_graph


_compat.wrap_flex_attention_gradient_graphs(_graphs_made_once)
