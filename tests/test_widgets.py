"""The calculator's callback (``render``) without a browser: bars are the planner's figures, and moving a
control changes the plot; the widget box builds and its controls are wired."""
import matplotlib
import pytest

matplotlib.use("Agg")

from mgpu_helpers.capstone import cached_trace, calculator, render, settings_plan  # noqa: E402
from mgpu_helpers.planner import plan_from_trace  # noqa: E402

S = dict(size="tiny", batch_size=4, seq_len=32, precision="bf16-autocast")


def bar_heights(fig):
    ax = fig.axes[0]
    return [round(r.get_height(), 9) for r in ax.patches]


def test_render_draws_the_planners_figures():
    fig, plan, line = render({**S, "world_size": 4, "zero_stage": 2})
    trace = cached_trace("tiny", 4, 32, "bf16-autocast", False, 1)
    assert plan == plan_from_trace(trace, 2, 4)
    top = max(r.get_y() + r.get_height() for r in fig.axes[0].patches)
    assert abs(top - max(plan_from_trace(trace, s, 4).peak_bytes for s in range(4)) / 1e9) < 1e-9
    assert "ZeRO-2 on 4 rank(s)" in line and "fits L4, A100-80GB, H200" in line


def test_moving_a_control_changes_the_plot():
    a = bar_heights(render({**S, "world_size": 1})[0])
    b = bar_heights(render({**S, "world_size": 8})[0])
    c = bar_heights(render({**S, "world_size": 8, "checkpointing": True})[0])
    assert a != b != c


def test_world_and_stage_need_no_new_trace():
    settings_plan(S)
    before = cached_trace.cache_info().misses
    for world in (1, 2, 64):
        for stage in range(4):
            settings_plan({**S, "world_size": world, "zero_stage": stage})
    assert cached_trace.cache_info().misses == before


def test_bad_settings():
    with pytest.raises(ValueError, match="unknown settings"):
        settings_plan({**S, "worldsize": 2})
    with pytest.raises(ValueError, match="micro_batches=3 does not divide batch_size=4"):
        settings_plan({**S, "micro_batches": 3})


def test_calculator_widget_updates_on_change():
    pytest.importorskip("ipywidgets")
    box = calculator(**S)
    sliders = {w.description: w for row in box.children[:3] for w in row.children}
    assert {"model size", "precision", "ZeRO stage", "world size", "checkpointing", "micro-batches"} <= set(sliders)
    status = box.children[3]
    first = status.value
    sliders["world size"].value = 8
    assert status.value != first and "on 8 rank(s)" in status.value
