from types import SimpleNamespace

import pytest

from kasoku.train.triggers import IntervalTrigger, ManualScheduleTrigger, get_trigger, never_fire


def fake_trainer(iteration, batches_per_epoch):
    """A trainer whose updater just finished step ``iteration``."""
    u = SimpleNamespace(iteration=iteration, previous_iteration=iteration - 1,
                        epoch_detail=iteration / batches_per_epoch,
                        previous_epoch_detail=(iteration - 1) / batches_per_epoch)
    return SimpleNamespace(updater=u)


def firing_iterations(trigger, start, stop, batches_per_epoch):
    return [i for i in range(start + 1, stop + 1)
            if trigger(fake_trainer(i, batches_per_epoch))]


def test_iteration_interval():
    assert firing_iterations(IntervalTrigger(3, "iteration"), 0, 10, 4) == [3, 6, 9]
    assert firing_iterations(get_trigger((1, "iteration")), 0, 4, 4) == [1, 2, 3, 4]


def test_epoch_interval():
    assert firing_iterations(IntervalTrigger(1, "epoch"), 0, 12, 4) == [4, 8, 12]
    assert firing_iterations(IntervalTrigger(2, "epoch"), 0, 12, 4) == [8]


def test_fractional_epochs():
    # 3 batches per epoch, every half epoch: crossings at 0.5 (it 2), 1.0 (3), 1.5 (5), 2.0 (6)
    assert firing_iterations(IntervalTrigger(0.5, "epoch"), 0, 6, 3) == [2, 3, 5, 6]
    # float rounding: 0.3 / 0.1 is 2.999..., the boundary at 0.3 must still be crossed once
    assert firing_iterations(IntervalTrigger(0.1, "epoch"), 0, 10, 10) == list(range(1, 11))
    assert IntervalTrigger(0.1, "epoch").fires(0.2, 0.3)
    assert not IntervalTrigger(0.1, "epoch").fires(0.3, 0.30000000000000004)


@pytest.mark.parametrize("spec", [(3, "iteration"), (0.5, "epoch"), (1, "epoch")])
@pytest.mark.parametrize("k", [1, 4, 5, 7])
def test_resume_from_the_middle_fires_the_same(spec, k):
    # stateless: a fresh trigger object after iteration k fires where the first would have
    whole = firing_iterations(get_trigger(spec), 0, 20, 6)
    split = firing_iterations(get_trigger(spec), 0, k, 6) + \
        firing_iterations(get_trigger(spec), k, 20, 6)
    assert whole == split


def test_manual_schedule():
    t = ManualScheduleTrigger([2, 5], "epoch")
    assert firing_iterations(t, 0, 30, 4) == [8, 20]
    assert firing_iterations(ManualScheduleTrigger(3, "iteration"), 0, 10, 4) == [3]
    assert t.reached(fake_trainer(8, 4)) and not t.reached(fake_trainer(7, 4))


def test_reached_for_stop_triggers():
    t = IntervalTrigger(2, "epoch")
    assert not t.reached(fake_trainer(7, 4))
    assert t.reached(fake_trainer(8, 4)) and t.reached(fake_trainer(9, 4))


def test_get_trigger_specs():
    assert get_trigger(None) is never_fire
    f = lambda trainer: True  # noqa: E731
    assert get_trigger(f) is f
    t = IntervalTrigger(2, "epoch")
    assert get_trigger(t) is t
    assert isinstance(get_trigger([5, "iteration"]), IntervalTrigger)
    with pytest.raises(ValueError, match="unit"):
        get_trigger((1, "epochs"))
    with pytest.raises(ValueError):
        get_trigger((0, "epoch"))
    with pytest.raises(ValueError):
        get_trigger((1.5, "iteration"))
    with pytest.raises(ValueError):
        get_trigger((1, "epoch", 2))
    with pytest.raises(TypeError):
        get_trigger(3)
