"""TorchTitan's llama3 debug model trains unmodified on tpu: ``torchrun -m
torchtitan.train`` in 2 processes, FSDP2 over ``init_process_group("tpu")``, its losses
and gradient norms step by step against the same run on the CPU with gloo.

TorchTitan 0.3.0 imports ``triton`` unconditionally, which torch 2.13.0's CPU build lacks:
these tests run in CI's torch 2.14.1 venv, where .ci/run installs TorchTitan and the
requirements its runs import (pinned, with ``--no-deps``), and skip elsewhere. The
reference is tests/titan_runner.py: TorchTitan's own ``main`` with the three things
replaced that keep it from running on the CPU (its docstring says which).
Both runs load one seed checkpoint, which the reference makes, and read a synthetic
dataset with a tokenizer built here: nothing is downloaded.

The debug model as its config has it (6 layers, dim 256, vocab 2048, FlexAttention),
at sequence length 64 for 3 steps: ~100 s on an idle 2-core machine. The seed
checkpoint takes ~10 s; then the tpu run ~85 s, most of it compiling the eager ops'
programs, and the reference (~20 s) beside it. A 1-process run would add ~55 s, so it
is not here.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time

import pytest

try:
    import torchtitan  # noqa: F401  (its modules load in the launched processes only)
except Exception as exc:
    pytest.skip(
        "TorchTitan does not import here; these tests run in CI's torch 2.14.1 venv, "
        "where .ci/run installs torchtitan==0.3.0 and its requirements with --no-deps: "
        f"{type(exc).__name__}: {exc}",
        allow_module_level=True,
    )

from test_distributed import SRC, _free_port_pair
from titan_runner import IMPORT_FAILED  # TorchTitan did not import in the runner: skip

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "titan_runner.py")
STEPS = 3

COMMON = [
    "--module", "llama3", "--config", "llama3_debugmodel",
    "--training.seq_len", "64", "--training.steps", str(STEPS),
]  # fmt: skip


def _write_assets(root) -> tuple[str, str]:
    """A word-level tokenizer (1,003 ids, within the debug model's 2,048) in
    TorchTitan's ``hf_assets_path`` layout, and a ``data.json`` of 64 documents in the
    c4_test dataset's form; both seeded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random(0)
    syllables = "ka lo mi tu re sa no pe di vu ga shi zo be fa ri".split()
    words = {"".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(3000)}
    words = sorted(words)[:1000]
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
    vocab = {token: i for i, token in enumerate(special + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    assets, data = root / "tokenizer", root / "data"
    assets.mkdir()
    data.mkdir()
    tokenizer.save(str(assets / "tokenizer.json"))
    config = {"bos_token": special[0], "eos_token": special[1], "unk_token": special[2]}
    (assets / "tokenizer_config.json").write_text(json.dumps(config))
    weights = [1 / (i + 1) for i in range(len(words))]  # Zipf's: something to learn
    lines = [
        json.dumps({"text": " ".join(rng.choices(words, weights, k=rng.randint(20, 150)))})
        for _ in range(64)
    ]
    (data / "data.json").write_text("\n".join(lines) + "\n")
    return str(assets), str(data)


def _env(root, cpu: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    # datasets' cache in the test's folder, and nothing fetched from the Hub
    env.update(HF_HOME=str(root / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    if cpu:  # `import torch` must not load torchtpu (tests/titan_runner.py)
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    return env


def _start(cmd: list[str], env: dict, log) -> tuple[subprocess.Popen, float, object]:
    """Start ``cmd``, its output to the file ``log`` (not a pipe: a run that fills one
    while the test waits on the other run would stop)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, time.monotonic(), log


def _finish(started, timeout: float) -> tuple[int, str]:
    """(returncode, output) of a process `_start` began; one still running ``timeout``
    seconds after it started is ended as test_distributed.launch ends one."""
    proc, start, log = started
    try:
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun stops its workers, which a SIGKILL of it would leave running
        proc.wait()
        return proc.returncode, log.read_text() + f"\n[still running after {timeout} s]"
    return proc.returncode, log.read_text()


def _torchrun(nproc: int, target: list[str], args: list[str], env: dict, log):
    port = _free_port_pair()  # MASTER_PORT + 1 is JAX's coordinator
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={port}", *target, *args]  # fmt: skip
    return _start(cmd, env, log)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.e+]+)\s+grad_norm:\s*([-\d.e+]+)")


def _steps(output: str, nproc: int) -> dict[int, tuple[float, float]]:
    """{step: (loss, grad_norm)} from TorchTitan's metric lines; every rank logs the
    same global values, and each must."""
    seen: dict[int, list[tuple[float, float]]] = {}
    for m in _STEP.finditer(_ANSI.sub("", output)):
        seen.setdefault(int(m[1]), []).append((float(m[2]), float(m[3])))
    assert sorted(seen) == list(range(1, STEPS + 1)), output[-6000:]
    for step, values in seen.items():
        assert len(values) == nproc and len(set(values)) == 1, (step, values)
    return {step: values[0] for step, values in seen.items()}


@pytest.fixture(scope="module")
def titan(tmp_path_factory):
    """The assets, and the seed checkpoint both runs load: TorchTitan's own
    ``--checkpoint.create_seed_checkpoint`` (1 process, initialised on the CPU, seeded),
    by the runner without torchrun."""
    root = tmp_path_factory.mktemp("titan")
    assets, data = _write_assets(root)
    common = [*COMMON, "--hf_assets_path", assets, "--dataloader.dataset_path", data]
    env = _env(root, cpu=True)
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port_pair()))  # fmt: skip
    seed = root / "seed"
    args = [*common, "--dump_folder", str(seed), "--debug.seed", "0", "--checkpoint.enable"]
    args.append("--checkpoint.create_seed_checkpoint")  # the same weights every time
    rc, output = _finish(_start([sys.executable, RUNNER, *args], env, root / "seed.log"), 150)
    if rc == IMPORT_FAILED:
        pytest.skip(
            "TorchTitan does not import here; these tests run in CI's torch 2.14.1 venv "
            f"(.ci/run):\n{output[-1500:]}"
        )
    assert rc == 0, output[-6000:]
    checkpoint = seed / "checkpoint" / "step-0"
    assert (checkpoint / ".metadata").exists(), output[-3000:]
    load = ["--checkpoint.enable", "--checkpoint.load_only"]
    load += ["--checkpoint.initial_load_path", str(checkpoint)]
    return root, [*common, *load]


@pytest.mark.timeout(600)  # past the runs' own limits, which end them: 150 s, then 420 s
def test_fsdp2_two_processes_match_gloo_on_the_cpu(titan):
    root, args = titan
    args = [*args, "--parallelism.data_parallel_shard_degree", "2"]
    tpu_args = [*args, "--dump_folder", str(root / "tpu2")]  # TorchTitan as it is
    cpu_args = [*args, "--dump_folder", str(root / "cpu2")]
    tpu_env, cpu_env = _env(root, cpu=False), _env(root, cpu=True)
    runs = []
    try:
        runs.append(_torchrun(2, ["-m", "torchtitan.train"], tpu_args, tpu_env, root / "tpu2.log"))
        runs.append(_torchrun(2, [RUNNER], cpu_args, cpu_env, root / "cpu2.log"))
        rc_cpu, out_cpu = _finish(runs[1], timeout=300)
        rc_tpu, out_tpu = _finish(runs[0], timeout=420)
    finally:  # neither run outlives the test (pytest-timeout's signal, an interrupt)
        for proc, *_ in runs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    assert rc_cpu == 0, out_cpu[-6000:]
    assert rc_tpu == 0, out_tpu[-6000:]
    assert "TPU capacity" in out_tpu and "CPU capacity" in out_cpu  # the devices TorchTitan chose
    got, want = _steps(out_tpu, 2), _steps(out_cpu, 2)
    for step in want:
        assert got[step][0] == pytest.approx(want[step][0], rel=1e-3), (step, got, want)
        assert got[step][1] == pytest.approx(want[step][1], rel=1e-3), (step, got, want)
    assert want[STEPS][0] < want[1][0]  # it trains
