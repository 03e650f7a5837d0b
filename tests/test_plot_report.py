"""PlotReport's charts: a title and labels, the loss on a log axis from epoch 0, one log entry
drawn as a labelled point (not a dot on an arbitrary axis), a diverged value left out."""
import math

from kasoku.train.extensions import PlotReport

KEYS = ["main/loss", "validation/main/loss"]


def loss_plot():
    return PlotReport(KEYS, title="mnist-mlp: loss", ylabel="loss", log_y=True)


def test_a_chart_has_a_title_labels_and_a_log_loss_axis():
    log = [{"epoch": e, "main/loss": 2.3 / e ** 2, "validation/main/loss": 2.4 / e ** 2}
           for e in range(1, 21)]
    ax = loss_plot().figure(log).axes[0]
    assert ax.get_title() == "mnist-mlp: loss"
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_yscale()) == ("epoch", "loss", "log")
    assert ax.get_xlim()[0] == 0
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["training", "validation"]
    assert [len(line.get_xdata()) for line in ax.lines] == [20, 20]
    assert not ax.texts  # many points: no values written beside them


def test_one_epoch_is_a_labelled_point_on_an_axis_from_zero():
    ax = loss_plot().figure([{"epoch": 1, "main/loss": 2.407, "validation/main/loss": 2.344}]) \
        .axes[0]
    assert ax.get_xlim() == (0, 1.05)
    assert [line.get_linestyle() for line in ax.lines] == ["None", "None"]
    assert sorted(t.get_text() for t in ax.texts) == ["2.344", "2.407"]
    low, high = ax.get_ylim()
    assert low < 2.344 and high > 2.407


def test_values_that_are_not_finite_are_left_out():
    log = [{"epoch": 1, "main/loss": 2.0}, {"epoch": 2, "main/loss": math.nan},
           {"epoch": 3, "main/loss": math.inf}, {"epoch": 4, "main/loss": 1.0}]
    ax = loss_plot().figure(log).axes[0]
    assert list(ax.lines[0].get_xdata()) == [1, 4]


def test_accuracy_zooms_to_the_data_within_zero_to_one(tmp_path):
    plot = PlotReport(["main/accuracy", "validation/main/accuracy"], y_range=(0, 1),
                      ylabel="accuracy")
    log = [{"epoch": e, "main/accuracy": a, "validation/main/accuracy": v}
           for e, a, v in ((1, 0.9418, 0.9681), (2, 0.9761, 0.9741), (3, 0.9843, 0.9767))]
    ax = plot.figure(log).axes[0]
    low, high = ax.get_ylim()
    assert 0.9 < low < 0.9418 and 0.9843 < high <= 1.02  # the data fills the axis, whole
    assert ax.get_yscale() == "linear" and not ax.texts  # three points: no values written
    at_one = plot.figure([{"epoch": 1, "main/accuracy": 1.0}]).axes[0]
    assert 1.0 < at_one.get_ylim()[1] <= 1.02  # a point on the bound is not cut in half
    plot.draw([{"epoch": 1, "main/accuracy": 0.5}], tmp_path / "a.png")
    plot.draw([{"epoch": 1, "main/accuracy": 0.5}], tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


def tick_labels(ax):
    ax.figure.canvas.draw()
    low, high = ax.get_ylim()
    return [(t.get_position()[1], t.get_text()) for t in ax.yaxis.get_majorticklabels()
            if t.get_text() and low <= t.get_position()[1] <= high]


def test_log_axis_labels_are_numbers_that_do_not_crowd():
    across = [{"epoch": e, "main/loss": 2.3 / e ** 2} for e in range(1, 21)]  # 2.3 to 0.006
    assert {text for _, text in tick_labels(loss_plot().figure(across).axes[0])} >= \
        {"0.01", "0.1", "1"}
    for log in ([{"epoch": e, "main/loss": 0.5 - 0.01 * e} for e in range(1, 11)],  # a decade
                [{"epoch": 1, "main/loss": 0.19}, {"epoch": 2, "main/loss": 0.075},
                 {"epoch": 3, "main/loss": 0.05}]):  # mnist-mlp's first three epochs
        ax = loss_plot().figure(log).axes[0]
        labels = tick_labels(ax)
        assert len(labels) >= 2
        low, high = (math.log10(v) for v in ax.get_ylim())
        at = sorted((math.log10(v) - low) / (high - low) for v, _ in labels)
        # neighbours at least 7% of the axis apart: no 0.06, 0.07, 0.08, 0.09 pile-up
        assert all(b - a >= 0.07 for a, b in zip(at, at[1:])), labels


def test_lines_logged_between_epochs_plot_against_the_progress():
    # kasoku train plots against epoch_detail: log lines every N iterations fall in between.
    plot = PlotReport(["main/loss"], x_key="epoch_detail", xlabel="epoch", log_y=True)
    log = [{"epoch": i // 4, "epoch_detail": i / 4, "main/loss": 1.0 / i} for i in range(1, 9)]
    ax = plot.figure(log).axes[0]
    assert list(ax.lines[0].get_xdata()) == [i / 4 for i in range(1, 9)]
    assert ax.get_xlabel() == "epoch"


def test_one_epochs_close_losses_still_have_numbers_on_the_axis():
    # A one-epoch run's two losses, 4% apart: none of the 1-1.5-2-3 steps falls between them.
    ax = loss_plot().figure([{"epoch": 1, "main/loss": 2.291,
                              "validation/main/loss": 2.198}]).axes[0]
    labels = tick_labels(ax)
    assert len(labels) >= 2, labels
    texts = [text for _, text in labels]
    assert len(set(texts)) == len(texts)
    assert all(abs(float(text) - value) < 1e-9 for value, text in labels)
