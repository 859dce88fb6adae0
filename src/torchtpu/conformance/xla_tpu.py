"""Compile every program this process runs for a TPU v5e as well, without a TPU.

libtpu holds XLA:TPU's compiler, and JAX can compile for a TPU *topology* that is not
attached ("compile-only" devices), so this machine -- and CI -- can learn what XLA:TPU
does with each program torchtpu builds: compiles it, refuses it with an error
(``UNIMPLEMENTED`` for a 64-bit HLO it cannot rewrite), or aborts the process (a CHECK
failure: a notebook's kernel dies with no Python error). The last is why the compiles
run in a child process, the *compiler*: an abort there is recorded against the module
and the child replaced, and the program under test carries on.

``watch()`` hooks JAX's lowering in this process: each program lowered for the CPU
(the backend this process runs on) is lowered again for the TPU platform (JAX's
per-platform lowering rules: cumulative sums, linear algebra, random bits differ)
and sent to the compiler, synchronously, so that a verdict belongs to the op or test
that made the program::

    with xla_tpu.watch() as verdicts:
        run_some_ops()
    assert not [v for v in verdicts if v.outcome != "ok"]

The child needs ``libtpu`` (the release JAX pins: ``libtpu==0.0.42.*`` for JAX 0.10.2),
importable in it but kept off this process's path, so that JAX here never tries to
start a TPU backend: ``pip install --target .venv/libtpu "libtpu==0.0.42.*"`` (found
there by default; .ci/run does this), or any directory named by TORCHTPU_LIBTPU_DIR. A
program that compiles here still has to run on a chip: values, speed and memory are
the chip's to say.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import subprocess
import sys
import tempfile

#: The topology compiled for: the first chip of a v5e host of 2x2 chips (libtpu names no
#: single-chip v5e topology; a program for one device compiles the same).
TOPOLOGY = "v5e:2x2"

#: Seconds one compile may take before the compiler is deemed hung and replaced.
COMPILE_TIMEOUT = 300.0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What XLA:TPU made of one program."""

    name: str  # the jitted function's name: an aten op (``aten.mm.default``), ``chunk``, ...
    outcome: str  # "ok", "error" (a Python exception from the compiler) or "abort"
    detail: str = ""  # the compiler's message, or how the child died


def libtpu_dir() -> str | None:
    """Where libtpu can be imported from for the compiler: ``TORCHTPU_LIBTPU_DIR``, else
    ``<venv>/libtpu`` (where .ci/run installs it), else beside JAX; None if nowhere."""
    import importlib.util

    from torchtpu import config

    for path in (config.libtpu_dir, os.path.join(sys.prefix, "libtpu")):
        if path and os.path.isdir(os.path.join(path, "libtpu")):
            return path
    if config.libtpu_dir:
        return None
    spec = importlib.util.find_spec("libtpu")
    return os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else None


def available() -> bool:
    return libtpu_dir() is not None


# -- the child ----------------------------------------------------------------------------
# A plain subprocess speaking over its stdin and stdout (a 4-byte length, then the text;
# one JSON line back): a multiprocessing child cannot be started by the conformance
# runner's daemonic workers.


def serve() -> None:
    """The compiler's loop: read StableHLO texts, answer {"kind": "ok" | "error", ...}."""
    import jax
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir
    from jax.experimental import topologies

    jax.config.update("jax_enable_x64", True)
    device = topologies.get_topology_desc(TOPOLOGY, "tpu").devices[0]
    devices = xc.DeviceList((device,))
    options = compiler.get_compile_options(
        num_replicas=1, num_partitions=1, device_assignment=[device]
    )
    requests, replies = sys.stdin.buffer, sys.stdout

    def reply(kind: str, detail: str = "") -> None:
        replies.write(json.dumps({"kind": kind, "detail": detail}) + "\n")
        replies.flush()

    reply("ready", device.device_kind)
    while True:
        header = requests.read(4)
        if len(header) < 4:
            return
        text = requests.read(int.from_bytes(header, "little")).decode()
        try:
            with mlir.make_ir_context():
                device.client.compile(
                    ir.Module.parse(text), executable_devices=devices, compile_options=options
                )
        except Exception as exc:
            reply("error", f"{type(exc).__name__}: {exc}")
        else:
            reply("ok")


class Compiler:
    """The child process compiling for the TPU; started again after an abort."""

    def __init__(self):
        path = libtpu_dir()
        if path is None:
            raise RuntimeError(
                "compiling for a TPU needs libtpu: pip install 'libtpu==0.0.42.*' (into a "
                "directory named by TORCHTPU_LIBTPU_DIR, to keep it off this process's path)"
            )
        self._path = path
        self._log = tempfile.NamedTemporaryFile(prefix="xla_tpu_", suffix=".log", delete=False).name
        self._process = None
        self.restarts = 0

    def _start(self) -> None:
        # Never open a chip, even where one is attached; and compile beside other libtpu
        # users (another compiler, a process holding the chip) despite libtpu's lockfile.
        env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (self._path, *sys.path) if p)
        with open(self._log, "w") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-c", "from torchtpu.conformance.xla_tpu import serve; serve()"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
            )
        kind, detail = self._receive(COMPILE_TIMEOUT)
        if kind != "ready":
            raise RuntimeError(f"the TPU compiler did not start: {detail}")

    def _receive(self, timeout: float) -> tuple[str, str]:
        ready, _, _ = select.select([self._process.stdout], [], [], timeout)
        line = self._process.stdout.readline() if ready else b""
        if line:
            answer = json.loads(line)
            return answer["kind"], answer["detail"]
        if not ready:
            self._process.kill()
        code = self._process.wait()
        self._process = None
        self.restarts += 1
        if not ready:
            how = f"no answer in {timeout:.0f} s"
        else:
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return "abort", f"the compiler process died ({how}): {_last_check(self._log)}"

    def compile(self, text: str) -> tuple[str, str]:
        if self._process is None:
            self._start()
        data = text.encode()
        try:
            self._process.stdin.write(len(data).to_bytes(4, "little") + data)
            self._process.stdin.flush()
        except BrokenPipeError:
            pass  # it died: _receive says how
        return self._receive(COMPILE_TIMEOUT)

    def close(self) -> None:
        if self._process is not None:
            with contextlib.suppress(Exception):
                self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
            self._process = None
        with contextlib.suppress(OSError):
            os.unlink(self._log)


def _last_check(log: str) -> str:
    """The fatal message an aborted compiler left in its log (XLA's ``F...`` lines)."""
    try:
        with open(log, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return "no log"
    fatal = [line for line in lines if line.startswith("F") or "Check failed" in line]
    return (fatal or lines or ["no message"])[-1][:500]


# -- the hook -----------------------------------------------------------------------------


@contextlib.contextmanager
def watch(compiler: Compiler | None = None, on_verdict=None):
    """Within: every program this process lowers is also compiled for the TPU. Yields
    the list of verdicts, in order; ``on_verdict(verdict)`` sees each as it comes."""
    from jax._src.interpreters import pxla

    from torchtpu.dispatch import host

    own = compiler is None
    compiler = compiler or Compiler()
    verdicts: list[Verdict] = []
    lower = pxla.lower_sharding_computation

    def lower_and_check(*args, **kwargs):
        computation = lower(*args, **kwargs)
        # Programs the platform policy runs on the host (dispatch/host.py) never reach XLA:TPU.
        if kwargs.get("lowering_platforms") is None and not getattr(host.running, "active", False):
            name = args[2] if len(args) > 2 else kwargs.get("name", "?")
            try:
                text = lower(*args, **dict(kwargs, lowering_platforms=("tpu",))).as_text()
            except Exception as exc:  # no TPU lowering rule for a primitive
                verdict = Verdict(name, "error", f"lowering: {type(exc).__name__}: {exc}")
            else:
                verdict = Verdict(name, *compiler.compile(text))
            verdicts.append(verdict)
            if on_verdict is not None:
                on_verdict(verdict)
        return computation

    pxla.lower_sharding_computation = lower_and_check
    try:
        yield verdicts
    finally:
        pxla.lower_sharding_computation = lower
        if own:
            compiler.close()
