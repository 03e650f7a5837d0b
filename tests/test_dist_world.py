"""``kasoku.distributed.World``: a process's place in a job, read from torchrun's environment, and
the single-process commands' refusal to run as one of several workers."""
import pytest

from kasoku.cli import main
from kasoku.core.errors import ConfigError
from kasoku.distributed import World, require_single_process


def test_the_environment_describes_the_world():
    assert World.from_env({}) == World(0, 1, 0) and World.from_env({}).is_main
    world = World.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert world == World(3, 4, 1) and not world.is_main


@pytest.mark.parametrize("env, message", [
    ({"RANK": "x"}, "RANK='x' is not a whole number"),
    ({"WORLD_SIZE": "-2"}, "WORLD_SIZE='-2'"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not in a world of WORLD_SIZE=4"),
])
def test_a_confused_environment_is_refused(env, message):
    with pytest.raises(ConfigError, match=message):
        World.from_env(env)


def test_commands_of_one_process_refuse_to_run_as_one_of_several(monkeypatch, capsys):
    require_single_process(World(0, 1, 0), "x")  # one process: fine
    with pytest.raises(ConfigError, match="process 1 of 2"):
        require_single_process(World(1, 2, 1), "kasoku train")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["bench", "sine-lstm"]) == 2
    assert "start it without torchrun" in capsys.readouterr().err
