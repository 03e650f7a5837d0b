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


def test_accuracy_keeps_zero_to_one(tmp_path):
    plot = PlotReport(["main/accuracy"], y_range=(0, 1), ylabel="accuracy")
    ax = plot.figure([{"epoch": 1, "main/accuracy": 0.5}]).axes[0]
    assert ax.get_ylim() == (0, 1) and ax.get_yscale() == "linear"
    plot.draw([{"epoch": 1, "main/accuracy": 0.5}], tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


def minor_labels(ax):
    ax.figure.canvas.draw()
    return [t.get_text() for t in ax.yaxis.get_minorticklabels() if t.get_text()]


def test_minor_ticks_are_labelled_within_one_decade_only():
    across = [{"epoch": e, "main/loss": 2.3 / e ** 2} for e in range(1, 21)]  # 2.3 to 0.006
    assert not minor_labels(loss_plot().figure(across).axes[0])
    within = [{"epoch": e, "main/loss": 0.5 - 0.01 * e} for e in range(1, 11)]  # 0.49 to 0.4
    assert minor_labels(loss_plot().figure(within).axes[0])


def test_lines_logged_between_epochs_plot_against_the_progress():
    # kasoku train plots against epoch_detail: log lines every N iterations fall in between.
    plot = PlotReport(["main/loss"], x_key="epoch_detail", xlabel="epoch", log_y=True)
    log = [{"epoch": i // 4, "epoch_detail": i / 4, "main/loss": 1.0 / i} for i in range(1, 9)]
    ax = plot.figure(log).axes[0]
    assert list(ax.lines[0].get_xdata()) == [i / 4 for i in range(1, 9)]
    assert ax.get_xlabel() == "epoch"
