"""The order's levers (search.strategy.lever_moves): the optimizer's implementations, the attention
kernels, fp8 and fused kernels, each tried once at the best so far, and fp8 and kernels only where
the host does not bound the step."""

from __future__ import annotations

from typing import Any

import pytest
from optuna.trial import FrozenTrial, create_trial

from search.core.records import COMPLETE
from search.strategy.book import FAILED, Book, Seen
from search.strategy.guided import seen_of
from search.strategy.order import next_move
from tests.strategy.test_strategy import drive, llm_like, walled

OPTIMIZERS = {"type": "categorical", "choices": ["foreach", "fused"]}
KERNELS = {"type": "categorical", "choices": ["torch", "liger"]}
FP8 = ("bf16", "fp8-tensorwise", "fp8-rowwise")


def compute_bound(c: dict[str, Any]) -> float:
    """Doubling the micro-batch gains next to nothing; fp8 and liger and fused each gain."""
    gain = {"bf16": 1.0, "fp8-tensorwise": 1.3, "fp8-rowwise": 1.2}[c["precision"]]
    gain *= 1.2 if c.get("kernels") == "liger" else 1.0
    gain *= 1.05 if c.get("optimizer") == "fused" else 1.0
    return gain * 1000.0 * c["micro_batch_size"] / (c["micro_batch_size"] + 0.05)


def host_bound(c: dict[str, Any]) -> float:
    """Twice the micro-batch, nearly twice the throughput: the host bounds the step."""
    return compute_bound(c) * (c["micro_batch_size"] + 0.05) / (c["micro_batch_size"] + 8)


AT_8 = {"batch_size": 8, "micro_batch_size": 8, "streams": 1, "recompute": False}
"""Batch and micro-batch 8, one lane, no recompute: where the histories below were measured."""


def seen_at(throughput: float, outcome: str = COMPLETE, **knobs: Any) -> Seen:
    """An outcome at ``AT_8`` with ``knobs``: a complete one at ``throughput`` (unit latency and
    memory), or ``outcome`` with no figures."""
    figures = {"throughput": throughput, "latency_p95_ms": 1.0, "peak_memory_mb": 1.0}
    return Seen({**AT_8, **knobs}, outcome, figures if outcome == COMPLETE else {})


def lever_moves(made: list[tuple[dict[str, Any], str]]) -> list[tuple[dict[str, Any], str]]:
    levers = ("the optimizer", "fp8", "fused kernels")
    return [(c, why) for c, why in made if any(word in why for word in levers)]


def test_the_first_guess_never_runs_fp8_nor_patched_kernels_and_uses_the_first_optimizer():
    space = llm_like(
        batch=(8, 8), micro=(1, 8), precisions=FP8, optimizer=OPTIMIZERS, kernels=KERNELS
    )
    first, why = drive(space, walled(4, compute_bound), budget=1)[0]
    assert "first guess" in why
    assert (first["precision"], first["kernels"], first["optimizer"]) == (
        "bf16",
        "torch",
        "foreach",
    )


def test_where_compute_binds_each_lever_is_tried_once_at_the_best_so_far_saying_why():
    space = llm_like(
        batch=(8, 8), micro=(1, 8), precisions=FP8, optimizer=OPTIMIZERS, kernels=KERNELS
    )
    made = drive(space, walled(4, compute_bound), budget=10)
    levers = lever_moves(made)
    tried = [(c["optimizer"], c["precision"], c["kernels"]) for c, _ in levers]
    # the optimizer first (fused wins), then liger from the fused best, then each fp8 recipe from
    # the fastest so far (liger)
    assert tried == [
        ("fused", "bf16", "torch"),
        ("fused", "bf16", "liger"),
        ("fused", "fp8-tensorwise", "liger"),
        ("fused", "fp8-rowwise", "liger"),
    ]
    assert all(c["micro_batch_size"] == 4 for c, _ in levers)  # the wall found by the opening
    assert "host does not bound" in levers[1][1] and "host does not bound" in levers[3][1]
    assert all("compile" not in c for c, _ in levers)  # this space cannot compile


def test_fp8_is_tried_compiled_where_the_space_can_compile_and_the_line_says_so():
    compile_modes = {"type": "categorical", "choices": ["off", "default", "max-autotune"]}
    space = llm_like(batch=(8, 8), micro=(1, 8), precisions=FP8, compile=compile_modes)

    def eager_wins(c: dict[str, Any]) -> float:  # the compiler loses at bf16, so the best is eager
        return compute_bound(c) * (0.9 if c["compile"] != "off" and c["precision"] == "bf16" else 1)

    made = drive(space, walled(4, eager_wins), budget=12)
    fp8_moves = [(c, why) for c, why in made if c["precision"].startswith("fp8")]
    assert [c["precision"] for c, _ in fp8_moves][:2] == ["fp8-tensorwise", "fp8-rowwise"]
    # the first from the eager best, compiled; the second from it, which compiles already
    assert all(c["compile"] == "default" for c, _ in fp8_moves[:2])
    assert "compiled (default)" in fp8_moves[0][1]


def test_where_the_host_bounds_the_step_fp8_and_fused_kernels_wait():
    space = llm_like(batch=(8, 8), micro=(1, 8), precisions=FP8, kernels=KERNELS)
    made = drive(space, walled(4, host_bound), budget=10)
    assert not lever_moves(made)
    assert all(
        c["precision"] == "bf16" and c["kernels"] == "torch"
        for c, why in made
        if "local search" not in why
    )


def test_where_another_precision_becomes_the_fastest_the_compiler_is_tried_again_there():
    compile_modes = {"type": "categorical", "choices": ["off", "default"]}
    space = llm_like(batch=(8, 8), micro=(1, 8), precisions=("fp32", "bf16"), compile=compile_modes)
    # a CPU without bf16 instructions: the first guess and its compiled twin are slow, fp32 fast
    history = [
        seen_at(50.0, precision="bf16", compile="off"),
        seen_at(60.0, precision="bf16", compile="default"),
        seen_at(900.0, precision="fp32", compile="off"),
    ]
    move = next_move(space, history)
    assert move is not None and move.why.startswith("the compiler")
    assert move.config["precision"] == "fp32" and move.config["compile"] == "default"


def test_each_attention_kernel_is_tried_once_after_the_compiler_and_the_rest_starts_from_it():
    compile_modes = {"type": "categorical", "choices": ["off", "default"]}
    # math listed first: the first guess must still keep torch's own pick
    kernels = {"type": "categorical", "choices": ["math", "default"]}
    space = llm_like(
        batch=(8, 8), micro=(1, 8), precisions=("bf16",), compile=compile_modes, attention=kernels
    )

    def math_wins(c: dict[str, Any]) -> float:  # as on the 2-core CPU: math 1.2x, compiled 1.4x
        gain = 1.2 if c["attention"] == "math" else 1.0
        return compute_bound(c) * gain * (1.4 if c["compile"] != "off" else 1.0)

    made = drive(space, walled(4, math_wins), budget=14)
    first = made[0][0]
    assert first["attention"] == "default" and first["compile"] == "off"
    whys = [why for _, why in made]
    compiler = next(i for i, why in enumerate(whys) if why.startswith("the compiler"))
    kernel = [i for i, why in enumerate(whys) if why.startswith("the attention kernel")]
    assert len(kernel) == 1 and kernel[0] > compiler
    tried = made[kernel[0]][0]
    assert tried["attention"] == "math" and tried["compile"] == "default"
    assert "math at the best so far" in whys[kernel[0]]
    # every move after it starts from the winner
    after = [c for c, why in made[kernel[0] + 1 :] if "local search" not in why]
    assert after and all(c["attention"] == "math" for c in after)


def test_where_the_attention_kernel_loses_the_rest_keeps_torch_own_pick():
    kernels = {"type": "categorical", "choices": ["default", "math"]}
    space = llm_like(batch=(8, 8), micro=(1, 8), precisions=("bf16",), attention=kernels)

    def math_loses(c: dict[str, Any]) -> float:  # as on a GPU at long sequences
        return compute_bound(c) * (0.5 if c["attention"] == "math" else 1.0)

    made = drive(space, walled(4, math_loses), budget=12)
    kernel = [i for i, (_, why) in enumerate(made) if why.startswith("the attention kernel")]
    assert len(kernel) == 1
    after = [c for c, why in made[kernel[0] + 1 :] if "local search" not in why]
    assert after and all(c["attention"] == "default" for c in after)


def test_a_kernel_refused_at_an_fp32_best_is_tried_again_where_a_half_precision_wins():
    # On CUDA flash takes no fp32 input: at an fp32 best it was infeasible (not run); once bf16 is
    # the fastest, flash is measured there, once
    kernels = {"type": "categorical", "choices": ["default", "flash"]}
    space = llm_like(batch=(8, 8), micro=(1, 8), precisions=("bf16", "fp32"), attention=kernels)
    at_fp32 = [
        seen_at(900.0, precision="fp32", attention="default"),
        seen_at(0.0, FAILED, precision="fp32", attention="flash"),
    ]
    bf16 = seen_at(1000.0, precision="bf16", attention="default")
    move = next_move(space, [*at_fp32, bf16])
    assert move is not None and move.why == "the attention kernel: flash at the best so far"
    assert move.config["precision"] == "bf16" and move.config["attention"] == "flash"
    measured = seen_at(1100.0, precision="bf16", attention="flash")
    then = next_move(space, [*at_fp32, bf16, measured])
    assert then is not None and not then.why.startswith("the attention kernel"), then


def test_the_order_reads_a_trial_measured_in_two_processes_as_its_line_does():
    # A default run on the 2-core CPU: math's first process read 11.9k and its second 11.0k
    # (its line: 11.5k), torch's pick 11.4k then 12.0k (11.7k). Read from the first process
    # alone, math was the best so far and every later move started from it.
    kernels = {"type": "categorical", "choices": ["default", "math"]}
    space = llm_like(batch=(32, 32), micro=(16, 16), precisions=("fp32",), attention=kernels)
    base = {"batch_size": 32, "micro_batch_size": 16, "precision": "fp32", "streams": 1}

    def trial(kernel: str, first: float, second: float | None) -> FrozenTrial:
        figures = {"throughput": first, "latency_p95_ms": 370.0, "peak_memory_mb": 250.0}
        attrs = {
            "state": COMPLETE,
            "config": {**base, "recompute": False, "attention": kernel},
            "metrics": figures,
        }
        if second is not None:
            again = {"throughput": second}
            attrs["second_process"] = {"state": COMPLETE, "time_s": 0.0, "metrics": again}
        return create_trial(values=[first, 370.0, 250.0], user_attrs=attrs)

    both = [trial("default", 11421.7, 11979.0), trial("math", 11943.1, 11012.9)]
    best = Book(space, seen_of(both, [], space), [], {}).best()
    assert best is not None and best.config["attention"] == "default"
    assert best.figures["throughput"] == pytest.approx(11700.35)
    # one process each: the first runs' figures, as before
    first_only = [trial("default", 11421.7, None), trial("math", 11943.1, None)]
    best = Book(space, seen_of(first_only, [], space), [], {}).best()
    assert best is not None and best.config["attention"] == "math"


def test_a_lever_that_ties_is_not_stacked_on_the_order_goes_on_from_the_plainer():
    modes = {"type": "categorical", "choices": ["off", "default"]}
    space = llm_like(
        batch=(8, 8), micro=(8, 8), precisions=("bf16",), optimizer=OPTIMIZERS, compile=modes
    )

    def at(throughput: float, **knobs: Any) -> Seen:
        seen = seen_at(throughput, precision="bf16", optimizer="foreach", **knobs)
        interval = {"throughput_ci_low": throughput - 30, "throughput_ci_high": throughput + 30}
        return Seen(seen.config, COMPLETE, {**seen.figures, **interval})

    tie = [at(1000.0, compile="off"), at(1040.0, compile="default")]
    best = Book(space, tie, [], {}).best()
    assert best is not None and best.config["compile"] == "off"
    move = next_move(space, tie)
    assert move is not None and move.config["compile"] == "off"  # the optimizer, on eager
    win = [at(1000.0, compile="off"), at(1100.0, compile="default")]
    best = Book(space, win, [], {}).best()
    assert best is not None and best.config["compile"] == "default"
    move = next_move(space, win)
    assert move is not None and move.config["compile"] == "default"  # stacked on the compiler
    assert move.why == "the optimizer: fused at the best so far, stacked on compile=default"


def test_the_compiler_is_tried_at_each_precision_that_ties_the_best_eagerly():
    """fp32 and bf16 within noise of each other eagerly: the compiler is tried at both, since
    which one it speeds up most is the device's; not at a precision that is surely slower."""
    modes = {"type": "categorical", "choices": ["off", "default"]}
    space = llm_like(batch=(8, 8), micro=(4, 8), precisions=("fp32", "bf16"), compile=modes)

    def at(throughput: float, **knobs: Any) -> Seen:
        seen = seen_at(throughput, **knobs)
        interval = {"throughput_ci_low": throughput - 30, "throughput_ci_high": throughput + 30}
        return Seen(seen.config, COMPLETE, {**seen.figures, **interval})

    tie = [at(1000.0, precision="bf16", compile="off"), at(1020.0, precision="fp32", compile="off")]
    compiled_fp32 = at(1300.0, precision="fp32", compile="default")  # surely the best now
    made = [next_move(space, tie), next_move(space, [*tie, compiled_fp32])]
    assert [(m.config["precision"], m.config["compile"]) for m in made if m] == [
        ("fp32", "default"),  # the best so far first
        ("bf16", "default"),
    ]
    assert made[1] is not None and "bf16, which ties the best so far eagerly" in made[1].why
    slower = [
        at(1000.0, precision="bf16", compile="off"),
        at(1200.0, precision="fp32", compile="off"),
    ]
    move = next_move(space, [*slower, at(1300.0, precision="fp32", compile="default")])
    assert move is not None and "ties the best so far" not in move.why
