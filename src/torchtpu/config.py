"""Every setting of torchtpu, declared once.

Each setting has one environment variable, read here and nowhere else. Code reads
``config.<name>``; tests and users may assign to it at run time.
"""

from __future__ import annotations

import json
import os


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def _env_mode() -> str:
    """The default eager mode: TORCHTPU_EAGER_MODE, or TorchTPU's own variables."""
    mode = os.environ.get("TORCHTPU_EAGER_MODE", "").strip().lower()
    if mode:
        return mode
    if _env_flag("TORCH_TPU_DEFER_AND_FUSE", False):
        return "defer"
    if _env_flag("TORCH_TPU_LAUNCH_BLOCKING", False):
        return "debug"
    return "strict"


#: Name of the eager mode a new process starts in: "strict", "debug" or "defer".
eager_mode: str = _env_mode()

#: Run ops that have neither a lowering nor a decomposition on the CPU (counted and
#: warned once per op). When False such ops raise NotImplementedError naming the op.
cpu_fallback: bool = _env_flag("TORCHTPU_CPU_FALLBACK", True)

#: A small op (tensors of 16 KiB or less) from a line that keeps meeting new shapes -- a
#: decoding loop's growing ``input_ids`` -- runs on the CPU instead of compiling an XLA
#: program for each shape (Note [Small ops of changing shapes run on the CPU] in
#: dispatch/small_ops.py; counted in ``metrics()["small_ops_on_cpu"]``).
small_ops_on_cpu: bool = _env_flag("TORCHTPU_SMALL_OPS_ON_CPU", True)

#: JAX's asynchronous dispatch on its CPU backend. It gains nothing for small ops and
#: costs a lot under contention (DESIGN.md §8), so it is off unless asked for. It only
#: takes effect before the JAX backend starts.
cpu_async_dispatch: bool = _env_flag("TORCHTPU_CPU_ASYNC_DISPATCH", False)

#: How many compiled per-op functions (and, separately, DeferAndFuse chunks) stay
#: cached; the least recently used are dropped beyond that. A compiled function
#: holds ~1-2 MB of host memory on XLA:CPU.
op_cache_size: int = int(os.environ.get("TORCHTPU_OP_CACHE_SIZE", "1024"))
chunk_cache_size: int = int(os.environ.get("TORCHTPU_CHUNK_CACHE_SIZE", "256"))


def _env_json(name: str, default):
    value = os.environ.get(name)
    return default if value is None or not value.strip() else json.loads(value)


#: XLA's options for the programs of single eager ops (Strict's and Debug's, and
#: `torchtpu.jit`'s eager first call), as ``jax.jit(..., compiler_options=...)`` takes
#: them; a JSON object in TORCHTPU_OP_COMPILER_OPTIONS (``{}``: XLA's defaults). Ops
#: compiled from then on use them. The default asks for the least effort on execution
#: time: one op leaves XLA little to optimise, and compiling is most of an eager first
#: step. On a TPU v5e, ten single-op programs compiled in 1.46 s instead of 4.24 s and
#: GPT-2 small's first Strict step took 22.5 s instead of 54.0 s, its later steps 261
#: against 252 ms (docs/performance.md). DeferAndFuse's chunks and torch.compile's
#: graphs use them too where they hold no product (an optimizer's update: Note [The
#: least effort for programs without products], dispatch/effort.py); the others, and
#: `torchtpu.jit`'s steps, keep XLA's defaults.
op_compiler_options: dict = _env_json(
    "TORCHTPU_OP_COMPILER_OPTIONS", {"exec_time_optimization_effort": -1.0}
)


#: Strict compiles an op's program on a worker thread while Python goes on; the ops
#: that need it (or its results) wait in a queue that runs once the program is ready,
#: or when a value is read (Note [Strict compiles in the background] in
#: dispatch/background.py). False: each op compiles in the calling thread before it
#: returns, as Debug mode does.
background_compiles: bool = _env_flag("TORCHTPU_BACKGROUND_COMPILES", True)

#: How many XLA programs compile at once in the background; 0: one fewer than the
#: host's cores, at most 4, at least 1. Read when the first compile starts.
compile_threads: int = int(os.environ.get("TORCHTPU_COMPILE_THREADS", "0"))


def _env_cache_dir() -> str | None:
    value = os.environ.get("TORCHTPU_COMPILE_CACHE_DIR")
    if value is not None:
        return None if value.strip().lower() in ("", "0", "off", "false", "no") else value
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "torchtpu", "xla")


#: torch.compile's graphs: the backward recomputes cheap pointwise ops from what the
#: forward keeps, rather than the forward keeping their results (AOTAutograd's min-cut
#: partition, as Inductor's; Note [The backward recomputes what is cheap] in
#: compile/backend.py). False: AOTAutograd's default partition, which keeps them.
compile_recompute: bool = _env_flag("TORCHTPU_COMPILE_RECOMPUTE", True)

#: Where compiled XLA programs persist between processes (JAX's persistent compilation
#: cache), so a second run of the same program warm-starts. None turns it off
#: (TORCHTPU_COMPILE_CACHE_DIR=0). Takes effect when the JAX runtime starts.
compile_cache_dir: str | None = _env_cache_dir()

#: Only programs that took at least this long to compile are written to that cache
#: (reading one back costs a few milliseconds). The cache is unbounded by default
#: (delete the directory to reclaim it): with a bound, JAX lists the whole directory on
#: every write to evict old entries, which made each compile ~1 s slower at 27,000
#: entries (an eager process writes one per op signature).
compile_cache_min_seconds: float = float(os.environ.get("TORCHTPU_COMPILE_CACHE_MIN_SECONDS", "0"))
compile_cache_max_bytes: int = int(os.environ.get("TORCHTPU_COMPILE_CACHE_MAX_BYTES", "-1"))

#: In Strict, an op whose outputs take at least this fraction of the device's memory
#: first waits for its inputs to be computed, so that the buffers ops before it dropped
#: are free when it allocates (Note [Strict waits before a large allocation] in
#: dispatch/plans.py). 0 never waits.
strict_wait_fraction: float = float(os.environ.get("TORCHTPU_STRICT_WAIT_FRACTION", str(1 / 32)))

#: DeferAndFuse flushes when this many ops are queued (a bound on a chunk's size and
#: on compile time, which grows faster than the size), even without a read of values.
#: It also flushes at the end of every ``optimizer.step()``.
defer_max_ops: int = int(os.environ.get("TORCHTPU_DEFER_MAX_OPS", "512"))

#: A DeferAndFuse queue of at least this many ops when ``optimizer.step()`` begins runs
#: then, and the optimizer's ops run as a chunk of their own (Note [The optimizer's step
#: is a chunk of its own] in dispatch/defer.py): the second step, whose optimizer state
#: exists, then compiles only the optimizer's chunk anew. So does one when a backward
#: pass begins (Note [The backward starts a chunk]: faster, for a little more memory).
defer_split_ops: int = int(os.environ.get("TORCHTPU_DEFER_SPLIT_OPS", "128"))

#: torch.compile(backend="tpu") captures ``.item()`` into its graphs: Dynamo's
#: ``capture_scalar_outputs``, set process-wide when the backend loads (Note [Values read
#: inside a compiled graph]). A user who set Dynamo's own variable,
#: TORCHDYNAMO_CAPTURE_SCALAR_OUTPUTS, keeps their choice.
compile_capture_scalars: bool = "TORCHDYNAMO_CAPTURE_SCALAR_OUTPUTS" not in os.environ

#: Warn when compiling DeferAndFuse chunks has taken this many seconds and more than
#: half of the time since the first compiled (perf_warnings.py).
compile_warn_seconds: float = float(os.environ.get("TORCHTPU_COMPILE_WARN_SECONDS", "10"))

#: Warn (once per user line) when a line has compiled this many programs, or has
#: flushed the DeferAndFuse queue this many times (perf_warnings.py).
recompile_warn_after: int = int(os.environ.get("TORCHTPU_RECOMPILE_WARN_AFTER", "8"))
flush_warn_after: int = int(os.environ.get("TORCHTPU_FLUSH_WARN_AFTER", "50"))

#: Deferred device-side checks (an index out of range) are checked at the latest when
#: this many are pending, even without a read of values.
max_pending_checks: int = int(os.environ.get("TORCHTPU_MAX_PENDING_CHECKS", "256"))

#: Which OpInfo conformance cases the test suite runs: "ci" (the first float32 forward
#: samples of every op, in Strict), "forward" (every float32 forward sample of every
#: variant, in Strict) or "full" (every dtype, gradients, error inputs, every mode).
#: See harness.SCOPES; ``python -m torchtpu.conformance --scope`` takes the same names.
conformance_scope: str = os.environ.get("TORCHTPU_CONFORMANCE", "ci").strip().lower()

#: Where JAX's multi-process coordinator listens (``host:port``) when
#: ``torch.distributed.init_process_group("tpu")`` starts it. Unset: MASTER_ADDR and
#: MASTER_PORT + 1 (torchrun sets both), else rank 0 picks a free port on the c10d
#: store's host and publishes it through the store (``mp.spawn`` with ``tcp://``).
distributed_coordinator: str | None = os.environ.get("TORCHTPU_DIST_COORDINATOR") or None

#: Before each collective, every rank of the group compares what it is about to run
#: (kind, shapes, dtypes, reduce op, root) with the others' through the c10d store, so
#: that a mismatch raises a clear error on every rank instead of a hang or garbage. It
#: costs three store requests (a set, a multi_get, a delete) per collective; off skips
#: them (TORCHTPU_DIST_CHECK=0).
distributed_check: bool = _env_flag("TORCHTPU_DIST_CHECK", True)

#: Seconds after which a rank whose heartbeat has stopped (killed, its host lost) counts
#: as gone: a rank waiting for it in a collective then raises DistBackendError naming it
#: (Note [Liveness] in distributed/liveness.py). 0 turns the watching off.
distributed_liveness_timeout: float = float(os.environ.get("TORCHTPU_DIST_LIVENESS_TIMEOUT", "30"))

#: A directory holding the ``libtpu`` package, for checking on a machine without a TPU
#: what XLA:TPU makes of torchtpu's programs (conformance/xla_tpu.py). Kept off
#: ``sys.path`` on purpose: with libtpu importable, JAX tries to start a TPU backend.
libtpu_dir: str | None = os.environ.get("TORCHTPU_LIBTPU_DIR") or None

#: A line on stderr while XLA compiles for longer than ``compile_progress_after``
#: seconds between two reads of values (observe/progress.py): a long first step is
#: never silent.
compile_progress: bool = _env_flag("TORCHTPU_COMPILE_PROGRESS", True)
compile_progress_after: float = float(os.environ.get("TORCHTPU_COMPILE_PROGRESS_AFTER", "2"))

#: scaled_dot_product_attention by JAX's Pallas flash kernels (ops/flash_attention.py),
#: and FlexAttention with a block mask and no score_mod by its splash kernel
#: (compile/flex_splash.py): "auto" on a TPU where the inputs allow, "on" on any backend
#: (interpreted off a TPU: for tests), "off" never. Read when an op's program is built.
flash_attention: str = os.environ.get("TORCHTPU_FLASH_ATTENTION", "auto").strip().lower()

#: FlexAttention over the blocks its BlockMask lists (compile/flex_blocks.py): "auto"
#: where they leave at most half of the scores, "on" whenever the block counts can be
#: read (eager modes), "off" never (torch's dense implementation: every score).
flex_blocks: str = os.environ.get("TORCHTPU_FLEX_BLOCKS", "auto").strip().lower()

#: A compile budget per user line (Note [A compile budget], observe/perf_warnings.py): a
#: line that compiles more XLA programs than ``compile_budget_programs``, or for longer
#: than ``compile_budget_seconds``, warns once (TPUCompileBudgetWarning), or raises
#: TPUCompileBudgetError where ``compile_budget_action`` is "error" (for CI). 0: no budget.
compile_budget_programs: int = int(os.environ.get("TORCHTPU_COMPILE_BUDGET_PROGRAMS", "0"))
compile_budget_seconds: float = float(os.environ.get("TORCHTPU_COMPILE_BUDGET_SECONDS", "0"))
compile_budget_action: str = os.environ.get("TORCHTPU_COMPILE_BUDGET_ACTION", "warn").strip().lower()

#: A torch.compile inference graph with dynamic sizes (``dynamic=True``, ``mark_dynamic``)
#: runs padded to buckets of its sizes (compile/buckets.py, Note [Shape buckets]): "pow2"
#: pads each dynamic size to the next power of two, at least ``shape_bucket_min`` (and
#: at most the size's upper bound), so that one program serves every size in a bucket
#: and padding at most doubles a dim; "off" compiles one program per size.
shape_buckets: str = os.environ.get("TORCHTPU_SHAPE_BUCKETS", "pow2").strip().lower()
shape_bucket_min: int = int(os.environ.get("TORCHTPU_SHAPE_BUCKET_MIN", "1"))

#: Which platform policy decides what the device's compiler is given (runtime/policy.py):
#: "auto" (the device's own: on a TPU, float64 and complex128 are kept and computed on
#: the host), "tpu" (the TPU's, on any backend: for tests on the CPU), "none".
platform_policy: str = os.environ.get("TORCHTPU_PLATFORM_POLICY", "auto").strip().lower()
