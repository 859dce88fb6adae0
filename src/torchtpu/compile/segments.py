"""A compiled graph that reads values: programs with the reads on the host between.

Note [Values read inside a compiled graph]
    Loading the tpu backend turns Dynamo's ``capture_scalar_outputs`` on (backend.py;
    Dynamo has no per-backend switch), so ``x.item()`` in a compiled region is a node of
    the graph (``aten._local_scalar_dense``, an *unbacked* symbol) instead of a graph
    break. An XLA program cannot turn its values into a Python number, so such a graph
    runs in segments: the nodes that need no value read run as one program, then the
    reads run eagerly (the same host read a graph break makes), then the nodes that
    depend on them as the next program, in which the numbers read are static, like a
    size (a new value compiles that program once more, as a new shape after a graph
    break does). Each node goes in the earliest segment its inputs allow, so reads
    that do not depend on each other (a MoE router's expert counts) share one segment.
    Against a graph break, the user's frame never leaves Dynamo's graph: no resumed
    frames with guards of their own, and the ops on either side of a read still fuse.
    The reads are counted by op (``torchtpu.metrics()["graph_reads"]``).

    A node reads values if its op is tagged ``data_dependent_output``
    (``_local_scalar_dense``, ``equal``), or ``dynamic_output_shape`` (``nonzero``, where
    Dynamo captures one) and its output's shape has a new unbacked symbol. Other ops
    whose sizes involve a value read (a slice up to it) run in the programs after the
    read, where that value is static.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from torchtpu._compat import split_module_returning_tuples
from torchtpu.compile.program import flatten_values, unflatten_values
from torchtpu.observe import metrics


def reads_values(gm: torch.fx.GraphModule) -> bool:
    """Whether any node of ``gm`` reads values (Note [Values read inside a compiled graph])."""
    return any(_reads_values(node) for node in gm.graph.nodes)


def _reads_values(node: torch.fx.Node) -> bool:
    """``.item()`` and the like (a value), or an op whose output shape is one here
    (``aten.index`` is tagged dynamic for boolean masks; with integer indices its shape
    is known)."""
    tags = getattr(node.target, "tags", ()) if node.op == "call_function" else ()
    if torch.Tag.data_dependent_output in tags:
        return True
    if torch.Tag.dynamic_output_shape not in tags:
        return False
    given = set()
    for arg in node.all_input_nodes:
        given |= free_unbacked_symbols(arg.meta.get("val"))
    return bool(free_unbacked_symbols(node.meta.get("val")) - given)


def _partitions(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    """Each node's partition: program segment ``k`` is partition ``2k``, the reads
    between segments ``k`` and ``k + 1`` partition ``2k + 1``. A node's segment is the
    latest among its inputs' (a read's result belongs to the segment after it)."""
    segment: dict[torch.fx.Node, int] = {}
    partition: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        earliest = max((segment[a] for a in node.all_input_nodes), default=0)
        if _reads_values(node):
            partition[node] = 2 * earliest + 1
            segment[node] = earliest + 1
        else:
            partition[node] = 2 * earliest
            segment[node] = earliest
    return partition


class Segmented:
    """``gm`` as programs and host reads (Note [Values read inside a compiled graph]),
    called like a Program: ``(static, arrays) -> (output arrays, layout)``, with the
    tensors described in ``static`` by their dtype."""

    def __init__(self, gm: torch.fx.GraphModule, program_of):
        partition = _partitions(gm)
        # Every segment returns a tuple, whatever its number of outputs.
        self._split = split_module_returning_tuples(gm, lambda node: partition[node])
        for name, part in list(self._split.named_children()):
            if reads_values(part):  # partitions 2k + 1 hold only the reads
                setattr(self._split, name, _ReadSegment(part))
            elif _makes_tensors(part):
                # A program segment: replaced by a callable of TPUTensors and numbers.
                setattr(self._split, name, _ProgramSegment(program_of(part)))
            # else only arithmetic on the values read, and the asserts on them: as it is

    def __call__(self, static, arrays: list):
        return flatten_values(self._split(*unflatten_values(static, arrays)))


def _makes_tensors(part: torch.fx.GraphModule) -> bool:
    return any(
        isinstance(node.meta.get("val"), torch.Tensor)
        for node in part.graph.nodes
        if node.op == "call_function"
    )


class _ProgramSegment(torch.nn.Module):
    def __init__(self, program):
        super().__init__()
        self.program = program

    def forward(self, *args):
        arrays, static = flatten_values(args)
        outputs, layout = self.program(static, arrays)
        return tuple(unflatten_values(layout, outputs))


class _ReadSegment(torch.nn.Module):
    """The reads between two programs, run eagerly on their concrete values."""

    def __init__(self, graph: torch.fx.GraphModule):
        super().__init__()
        self.graph_module = graph
        self.ops = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]

    def forward(self, *args):
        for op in self.ops:
            metrics.count("graph_reads", op)
        return self.graph_module(*args)
