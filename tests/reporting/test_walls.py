"""Where the memory wall lies, for each precision and recompute setting (search.reporting.walls)."""

from __future__ import annotations

from search.core.records import COMPLETE, FAILED, TrialRecord
from search.reporting.walls import memory_walls, wall_lines


def trial(number, micro, precision="bf16", recompute="none", streams=1, peak_mb=None):
    config = {
        "batch_size": 32,
        "micro_batch_size": micro,
        "precision": precision,
        "streams": streams,
        "recompute": recompute,
    }
    if peak_mb is None:
        return TrialRecord(
            number=number,
            config=config,
            state=FAILED,
            metrics={},
            stable=False,
            failure="oom: CUDA out of memory. Tried to allocate 256.00 MiB.",
        )
    metrics = {"throughput": 1.0, "peak_memory_mb": peak_mb}
    return TrialRecord(number=number, config=config, state=COMPLETE, metrics=metrics, stable=True)


H100_LLAMA = [  # the llama study's trials on an H100 (benchmarks/results), in their order
    trial(0, 32),
    trial(1, 4, peak_mb=42453.6),
    trial(2, 8, peak_mb=65169.4),
    trial(3, 16),
    trial(4, 16, recompute="attention"),
    trial(5, 16, recompute="mlp"),
    trial(6, 16, recompute="every-2", peak_mb=73780.5),
]


def test_each_precision_and_recompute_setting_has_its_own_wall():
    walls = {(w.precision, w.recompute): w for w in memory_walls(H100_LLAMA)}
    plain = walls[("bf16", "none")]
    assert (plain.fitted, plain.fitted_peak_mb, plain.ran_out) == (8, 65169.4, 16)
    assert walls[("bf16", "attention")].fitted is None
    assert walls[("bf16", "attention")].ran_out == 16
    every_2 = walls[("bf16", "every-2")]
    assert (every_2.fitted, every_2.ran_out) == (16, None)
    lines = wall_lines(list(walls.values()))
    assert "  bf16, recompute none: 8 fit (65.2 GB), 16 ran out" in lines
    assert "  bf16, recompute attention: none of those tried fit, 16 ran out" in lines
    assert "  bf16, recompute every-2: 16 fit (73.8 GB); none larger ran out" in lines


def test_an_out_of_memory_below_a_micro_batch_that_fit_is_no_wall_and_lanes_are_left_out():
    history = [
        trial(0, 4, peak_mb=500.0),
        trial(1, 8, precision="fp32"),
        trial(2, 2, precision="fp32", peak_mb=400.0),
        trial(3, 16, streams=2),  # two lanes hold two micro-batches' activations
        trial(4, 2),  # ran out below one that fit: a fault, not the wall
    ]
    walls = {(w.precision, w.recompute): w for w in memory_walls(history)}
    assert (walls[("bf16", "none")].fitted, walls[("bf16", "none")].ran_out) == (4, None)
    assert (walls[("fp32", "none")].fitted, walls[("fp32", "none")].ran_out) == (2, 8)
    assert "  fp32, recompute none: 2 fit (400 MB), 8 ran out" in wall_lines(list(walls.values()))


def test_no_wall_is_shown_where_nothing_ran_out_of_memory():
    assert memory_walls([trial(0, 4, peak_mb=1.0), trial(1, 8, peak_mb=2.0)]) == []
    assert wall_lines([]) == []
