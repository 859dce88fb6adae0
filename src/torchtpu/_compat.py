"""What differs between the torch and JAX releases torchtpu supports, in one place.

Every branch on a release lives here, named after the release and the change that
needs it; the rest of the package asks this module instead of testing versions or
probing torch's internals with ``hasattr``. docs/installation.md lists the releases,
docs/compatibility.md what each passed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util

import torch

#: The torch releases torchtpu supports: from the first (inclusive) to the second
#: (exclusive), as (major, minor). pyproject.toml states the same range.
TORCH_RANGE = ((2, 11), (2, 16))

_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def torch_at_least(major: int, minor: int) -> bool:
    return _TORCH >= (major, minor)


def check_torch() -> None:
    """Raise one clear error on a torch release outside `TORCH_RANGE` (called when the
    tpu device is first used, before any op is registered)."""
    if not TORCH_RANGE[0] <= _TORCH < TORCH_RANGE[1]:
        first, end = (".".join(map(str, v)) for v in TORCH_RANGE)
        raise RuntimeError(
            f"torchtpu supports torch {first} up to (not including) {end}; this is torch "
            f"{torch.__version__}. Install a supported release (pip install 'torch>={first},"
            f"<{end}'), or a torchtpu release made for this one."
        )


#: Ops that only some supported releases have: the overload's full name -> why. An op
#: listed here is lowered where the running torch has it and simply not elsewhere, as
#: torch itself has it or not.
VARYING_OPS = {
    # torch 2.14 removed the deprecated torch.cholesky and its aten op
    # (torch.linalg.cholesky, aten.linalg_cholesky_ex, replaces it).
    "aten.cholesky.default": "removed in torch 2.14",
    # foreach ops torch added: optimizers and torch._foreach_* use them where they exist
    "aten._foreach_clone.default": "added in torch 2.12",
    "aten._foreach_mm.default": "added in torch 2.13",
    # the chunked ops behind nn.functional.linear_cross_entropy, new in torch 2.13
    "torch_nn._linear_cross_entropy_batch_chunked.default": "added in torch 2.13",
    "torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default": "added in torch 2.13",
}

# The module that registers a namespace's ops, imported before looking one up.
_REGISTERED_BY = {"torch_nn": "torch.nn.modules.linear_cross_entropy"}


def op(name: str):
    """The op overload ``name`` (``"aten.cholesky.default"``), or None where this torch
    lacks it. Only ops listed in `VARYING_OPS` may be absent."""
    if name not in VARYING_OPS:
        raise KeyError(f"{name} is not listed in torchtpu._compat.VARYING_OPS")
    namespace, packet_name, overload = name.split(".")
    module = _REGISTERED_BY.get(namespace)
    if module is not None and importlib.util.find_spec(module) is not None:
        importlib.import_module(module)
    packet = getattr(getattr(torch.ops, namespace), packet_name, None)
    return None if packet is None else getattr(packet, overload, None)


#: OpInfo entries that torch's test database gained in a later supported release: the
#: conformance expectations may name them (an entry is stale only where torch has it).
OPINFO_FROM = {
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": (2, 14),
}


def premul_sum_factor(op) -> float:
    """The factor of a ``ReduceOp`` made by ``_make_nccl_premul_sum``. torch exposes it to
    Python from 2.13 (``ReduceOp.factor``); before, it is out of reach, and the reduction
    is refused clearly."""
    if not torch_at_least(2, 13):
        raise NotImplementedError(
            f"all_reduce with ReduceOp.PREMUL_SUM on tpu needs torch 2.13 or later: torch "
            f"{torch.__version__} does not expose the op's factor to Python. Multiply the "
            "tensor by the factor, then use ReduceOp.SUM."
        )
    factor = op.factor
    return factor.item() if isinstance(factor, torch.Tensor) else float(factor)


def dynamo_inline_when_called(trace_rules, module) -> None:
    """Dynamo skips the frames of ``module`` entered from skipped code, but inlines the
    module where code it traces calls it: torch 2.12 added the list for that
    (trace_rules.BUILTIN_INLINE_WHEN_CALLED, as torch does for ``copy``). Torch 2.11 has
    none and skips the module everywhere, as it skips ``copy``."""
    if torch_at_least(2, 12):
        trace_rules.BUILTIN_INLINE_WHEN_CALLED.add(trace_rules._module_dir(module))


def destroy_library(library: torch.library.Library) -> None:
    """Undo what ``library`` defined and registered (torch 2.11-2.15:
    ``Library._destroy``; torch does it when the object is collected, which a
    traceback holding its module can delay past the point where a retry defines the
    same ops again)."""
    library._destroy()


def dynamo_makes_optimizers_capturable_on(device_type: str) -> None:
    """Under torch.compile, Dynamo turns a new optimizer's ``capturable`` on -- its
    ``step`` counts on the parameters' device, so a compiled step makes no host round
    trip per parameter -- for CUDA and XPU parameters only (torch 2.11-2.15:
    ``OptimizerVariable._set_capturable`` tests ``p.is_cuda or p.is_xpu``). Do the same
    for ``device_type``'s, as torch's eager optimizers allow for the PrivateUse1 device
    (``optim.optimizer._get_capturable_supported_devices``)."""
    from torch._dynamo.variables import optimizer

    original = optimizer.OptimizerVariable._set_capturable
    if getattr(original, "for_device", None) == device_type:
        return

    def _set_capturable(self, tx):
        for group in self.value.param_groups:
            params = group.get("params", [])
            if (
                "capturable" in group
                and params
                and all(p.device.type == device_type and p not in self.value.state for p in params)
            ):
                group["capturable"] = True
        return original(self, tx)

    _set_capturable.for_device = device_type
    optimizer.OptimizerVariable._set_capturable = _set_capturable


def replace_flex_attention_device_check(check):
    """Make ``check(query, key, value)`` the device check of ``flex_attention``, which
    refuses any device outside a fixed set (torch 2.11-2.15: the module function
    ``torch.nn.attention.flex_attention._validate_device``, looked up at each call).
    Returns torch's check."""
    module = importlib.import_module("torch.nn.attention.flex_attention")
    original = getattr(module._validate_device, "torchs", module._validate_device)
    check.torchs = original
    module._validate_device = check
    return original


def wrap_flex_attention_gradient_graphs(wrap):
    """Make ``wrap(torchs)`` the function that traces score_mod's forward and gradient
    graphs in FlexAttention's autograd (torch 2.11-2.15: the module function
    ``torch._higher_order_ops.flex_attention.create_fw_bw_graph(score_mod,
    index_values, other_buffers)``, looked up at each call). Returns torch's."""
    module = importlib.import_module("torch._higher_order_ops.flex_attention")
    original = getattr(module.create_fw_bw_graph, "torchs", module.create_fw_bw_graph)
    replacement = wrap(original)
    replacement.torchs = original
    module.create_fw_bw_graph = replacement
    return original


def wrap_transformer_encoder_forward(forward):
    """Make ``forward`` ``nn.TransformerEncoder.forward`` (torch 2.11-2.15: ``forward(self,
    src, mask=None, src_key_padding_mask=None, is_causal=None)``, its nested-tensor fast
    path decided inside); returns torch's."""
    encoder = torch.nn.TransformerEncoder
    original = getattr(encoder.forward, "torchs", encoder.forward)
    forward.torchs = original
    functools.update_wrapper(forward, original, assigned=("__doc__", "__name__", "__qualname__"))
    encoder.forward = forward
    return original


def inductor_hands_graphs_on(device_type: str, backend) -> None:
    """torch.compile's default backend, Inductor (torch 2.11-2.15:
    ``torch._TorchCompileInductorWrapper.__call__(model, inputs, *, config_patches=None)``),
    has code generation registered for a "tpu" device that imports Google's
    ``torch_tpu`` package. Hand a graph that takes or makes tensors on
    ``device_type`` to ``backend()`` instead (a function returning the backend, so
    that it is imported when first needed); graphs on other devices go to Inductor as
    before. "Makes": ``create_block_mask(..., device="tpu", _compile=True)`` (which
    Transformers calls) compiles a graph with no tensor inputs that builds tpu tensors
    (Dynamo's ``example_value`` of each node says where)."""
    wrapper = torch._TorchCompileInductorWrapper
    original = getattr(wrapper.__call__, "torchs", wrapper.__call__)

    def on_device(x) -> bool:
        return isinstance(x, torch.Tensor) and x.device.type == device_type

    def __call__(self, model_, inputs_, **kwargs):
        if any(map(on_device, inputs_)) or any(
            on_device(node.meta.get("example_value")) for node in model_.graph.nodes
        ):
            return backend()(model_, inputs_)
        return original(self, model_, inputs_, **kwargs)

    __call__.torchs = original
    wrapper.__call__ = __call__


def register_higher_order_kernel(op, key, kernel) -> None:
    """``op.py_impl(key)(kernel)``, replacing an earlier kernel for ``key``: a start
    that failed imports its modules again when retried, and torch 2.11-2.15 refuse a
    second registration (``HigherOrderOperator.python_key_table``)."""
    op.python_key_table.pop(key, None)
    op.py_impl(key)(kernel)


def higher_order_ops_pass_the_aliasing_check(*ops) -> None:
    """The first call of a compiled function runs under AOTAutograd's
    ``_AnalyzeCustomOpInputOutputMode`` (torch 2.13-2.15, ``check_custom_op_aliasing``),
    which answers NotImplemented for tensor subclasses and lets the dispatcher ask the
    subclass next -- but a higher-order op returns a mode's NotImplemented as its result
    (``HigherOrderOperator.dispatch``). The mode checks no higher-order op, so ``ops``
    run without it, on to their subclass kernels."""
    runtime_wrappers = importlib.import_module("torch._functorch._aot_autograd.runtime_wrappers")
    mode = getattr(runtime_wrappers, "_AnalyzeCustomOpInputOutputMode", None)
    if mode is None:  # torch 2.11-2.12
        return
    for op in ops:
        if mode not in op.python_key_table:
            op.py_impl(mode)(lambda _mode, *args, _op=op, **kwargs: _op(*args, **kwargs))


def aot_inputs_overwritten() -> tuple[int, list] | None:
    """For the graph AOTAutograd is compiling now: (its number of inputs, the (input,
    output) positions of each input its epilogue overwrites with that output after
    every call), or None where torch does not say. torch 2.11-2.15 keep it in
    ``TracingContext.fw_metadata`` (a ``ViewAndMutationMeta``): the inputs in
    ``mutated_inp_runtime_indices`` get the graph's first outputs, in that order; one
    whose data, not only its metadata, is written gets a plain copy."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    indices = getattr(meta, "mutated_inp_runtime_indices", None)
    if indices is None:
        return None
    pairs = [
        (i, k)
        for k, i in enumerate(indices)
        if meta.input_info[i].mutates_data and not meta.input_info[i].mutates_metadata
    ]
    return len(meta.input_info), pairs


def aot_compiles_backward_with_forward():
    """A context in which AOTAutograd hands a graph's backward to its compiler with the
    forward, rather than at the first backward: torch 2.13's and 2.14's
    ``torch._functorch.config.force_non_lazy_backward_lowering`` (a release without
    it compiles the backward as before)."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return functorch_config.patch(force_non_lazy_backward_lowering=True)


# -- JAX -------------------------------------------------------------------------------
# JAX's internals torchtpu reads, each behind one function here (checked: JAX 0.10.x;
# pyproject.toml pins that range). Nothing here imports JAX at module level: ``import
# torch`` loads torchtpu, and JAX starts only when a tpu tensor needs it.


def split_module_returning_tuples(gm, partition):
    """``torch.fx.passes.split_module`` with every submodule returning a tuple, however
    many outputs it has (compile/segments.py calls them alike). torch 2.12 added its
    ``tuple_return``; on 2.11 a one-output submodule returns its value, and is made to
    return a 1-tuple here, its caller reading item 0."""
    import operator

    from torch.fx.passes.split_module import split_module

    if torch_at_least(2, 12):
        return split_module(gm, None, partition, tuple_return=True)
    split = split_module(gm, None, partition)
    for node in list(split.graph.nodes):
        if node.op != "call_module":
            continue
        child = getattr(split, node.target)
        output = next(n for n in child.graph.nodes if n.op == "output")
        if isinstance(output.args[0], (tuple, list)):
            continue
        output.args = ((output.args[0],),)
        child.recompile()
        with split.graph.inserting_after(node):
            first = split.graph.call_function(operator.getitem, (node, 0))
        node.replace_all_uses_with(first, delete_user_cb=lambda user, first=first: user is not first)
    split.recompile()
    return split


def jax_backends_started() -> bool:
    """Whether JAX has initialised its backends (jax._src.xla_bridge, JAX 0.4 to 0.10)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def jaxprs_in_params(params):
    """The sub-jaxprs an equation's parameters hold (jax._src.core, JAX 0.4.36 to 0.10)."""
    from jax._src import core

    return core.jaxprs_in_params(params)


def jax_distributed_client():
    """The client of JAX's coordination service that ``jax.distributed.initialize``
    connected (its key-value store; jax._src.distributed, JAX 0.4 to 0.10), or None."""
    from jax._src import distributed

    return distributed.global_state.client
