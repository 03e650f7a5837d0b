"""CUDA_DEVICE_MAX_CONNECTIONS: kasoku asks for 32 hardware queues before CUDA starts, keeps a
value the user set, and a side-stream loader warns once where CUDA already runs with fewer."""
import os
import warnings

import pytest
import torch

from kasoku.core import queues


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setenv(queues.ENV, "0")  # so that the variable is restored afterwards
    monkeypatch.delenv(queues.ENV)
    monkeypatch.setattr(queues, "_warned", False)
    # As in a process that has not started CUDA (on a GPU machine other tests have).
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)


def test_requested_before_cuda_starts():
    assert queues.queues() == queues.DEFAULT
    assert queues.request_queues()
    assert os.environ[queues.ENV] == "32" and queues.queues() == 32
    assert not queues.request_queues()  # already set: nothing to do


def test_a_value_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(queues.ENV, "4")
    assert not queues.request_queues()
    assert os.environ[queues.ENV] == "4" and queues.queues() == 4
    monkeypatch.setenv(queues.ENV, "many")
    assert queues.queues() == queues.DEFAULT  # CUDA ignores what it cannot read


def test_too_late_once_cuda_runs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert not queues.request_queues()
    assert queues.ENV not in os.environ
    with pytest.warns(UserWarning, match="CUDA_DEVICE_MAX_CONNECTIONS=32"):
        assert queues.check_queues("gpu-jpeg") == queues.DEFAULT
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        queues.check_queues("gpu-jpeg")  # once per process
    monkeypatch.setenv(queues.ENV, "32")
    monkeypatch.setattr(queues, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert queues.check_queues("gpu-jpeg") == 32


def test_the_command_line_asks_first():
    from kasoku.cli import main
    assert main(["list"]) == 0
    assert os.environ[queues.ENV] == "32"
