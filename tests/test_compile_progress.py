"""The progress line while XLA compiles (observe/progress.py): a long first step is
never silent, a short one says nothing, and a setting turns it off."""

from __future__ import annotations

import sys
import time

import pytest
import torch

import torchtpu
from torchtpu import config
from torchtpu.observe import progress


@pytest.fixture
def stderr(capsys, monkeypatch):
    progress.note_read()  # no burst from an earlier test
    capsys.readouterr()
    return capsys


def _new_program(n):
    """A value that needs a program no test has compiled yet (a shape of its own)."""
    return torch.ones(n, 7, 3, device="tpu").cumsum(1)


def test_a_burst_that_compiles_long_enough_says_so_and_how_it_ended(stderr, monkeypatch):
    monkeypatch.setattr(config, "compile_progress_after", 0.0)
    y = _new_program(11)
    torch.tpu.synchronize()  # Strict compiles on a worker: the line comes when it is done
    line = stderr.readouterr().err
    assert "torchtpu: compiling XLA programs since" in line and "test_compile_progress.py" in line
    assert ", now aten." in line  # the op compiling when it spoke
    y.sum().item()  # a read ends the burst
    last = stderr.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("torchtpu: compiled ") and "XLA program" in last


def test_short_compiles_say_nothing(stderr):
    assert config.compile_progress_after >= 1.0
    _new_program(12).sum().item()
    assert "torchtpu:" not in stderr.readouterr().err


def test_the_setting_turns_it_off(stderr, monkeypatch):
    monkeypatch.setattr(config, "compile_progress_after", 0.0)
    monkeypatch.setattr(config, "compile_progress", False)
    _new_program(13).sum().item()
    assert "torchtpu:" not in stderr.readouterr().err


@pytest.mark.parametrize("mode", ["defer", "jit"])
def test_chunks_and_compiled_steps_are_reported_too(stderr, monkeypatch, mode):
    monkeypatch.setattr(config, "compile_progress_after", 0.0)
    if mode == "defer":
        with torchtpu.set_eager_mode("defer"):
            _new_program(14 + len(mode)).sum().item()
        what = "a DeferAndFuse chunk"
    else:
        step = torchtpu.jit(lambda x: x.cumsum(0).sum())
        x = torch.ones(5, 21, device="tpu")
        step(x).item()  # eager: finds the state
        step(x).item()  # traces and compiles the step: a burst of its own
        what = "a compiled step"
    assert what in stderr.readouterr().err


def test_one_long_compile_is_reported_while_it_runs(stderr, monkeypatch):
    # A compile releases the GIL: the watcher thread speaks before it ends.
    monkeypatch.setattr(config, "compile_progress_after", 0.2)
    with progress.compiling("a slow program", "here"):
        time.sleep(0.2 + 3 * progress._POLL)
        during = stderr.readouterr().err
    assert "compiling XLA programs since here: 0 done" in during and "now a slow program" in during
    progress.note_read()
    assert "compiled 1 XLA program in" in stderr.readouterr().err


@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_compile_seconds_are_counted_by_the_line_that_caused_them(mode, monkeypatch):
    """``metrics()["compile_seconds_by_line"]``: where a first step's compile time went,
    by user line (issue 32's compile budget), whether or not the progress line shows."""
    monkeypatch.setattr(config, "compile_progress", False)
    torchtpu.reset_metrics()
    with torchtpu.set_eager_mode(mode):
        y = _new_program(17 + len(mode))  # Strict compiles in _new_program
        y.sum().item()  # DeferAndFuse compiles the chunk here
        read = f"{__file__}:{sys._getframe().f_lineno - 1} in "
    by_line = torchtpu.metrics()["compile_seconds_by_line"]
    if mode == "strict":
        assert any(where.endswith(" in _new_program") for where in by_line), by_line
    else:
        assert list(by_line) == [read + sys._getframe().f_code.co_name], by_line
    assert all(seconds > 0 for seconds in by_line.values())
