"""The expert's order (search.strategy.order) and the guided sampler (search.strategy.guided) on
known workloads."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from search.core.records import COMPLETE
from search.space.parse import parse_space
from search.strategy.book import FAILED, FIDELITY, OOM, Book, Seen
from search.strategy.guided import HANDED_OVER, WHY, GuidedSampler
from search.strategy.move import ladder_step
from search.strategy.order import next_move
from search.strategy.samplers import suggest

OBJECTIVES = {"throughput": "maximize", "latency_p95_ms": "minimize", "peak_memory_mb": "minimize"}


def llm_like(batch=(4, 64), micro=(1, 64), precisions=("fp32", "bf16"), **extra_params):
    return parse_space(
        "t",
        {
            "workload": {"_target_": "x"},
            "params": {
                "batch_size": {"type": "int", "low": batch[0], "high": batch[1], "pow2": True},
                "micro_batch_size": {
                    "type": "int",
                    "low": micro[0],
                    "high": micro[1],
                    "pow2": True,
                },
                "precision": {"type": "categorical", "choices": list(precisions)},
                "streams": {"type": "int", "low": 1, "high": 2},
                "recompute": {"type": "bool"},
                **extra_params,
            },
            "constraints": [
                "batch_size % micro_batch_size == 0",
                "streams <= batch_size // micro_batch_size",
            ],
            "memory_grows_with": ["batch_size", "micro_batch_size"],
            "objectives": OBJECTIVES,
        },
    )


Oracle = Callable[[Mapping[str, Any]], Seen]


def walled(wall: int, speed: Callable[[Mapping[str, Any]], float] | None = None) -> Oracle:
    """Micro-batches above ``wall`` run out of memory (above ``2 * wall`` with recompute)."""

    def run(c: Mapping[str, Any]) -> Seen:
        limit = wall * (2 if c["recompute"] else 1) // c["streams"]
        if c["micro_batch_size"] > limit:
            return Seen(dict(c), OOM, {})
        thr = speed(c) if speed else 1000.0 * c["micro_batch_size"] / (c["micro_batch_size"] + 4)
        step_ms = c["batch_size"] / thr * 1000
        memory = 10.0 * c["micro_batch_size"] * c["streams"] * (0.4 if c["recompute"] else 1)
        figures = {"throughput": thr, "latency_p95_ms": step_ms, "peak_memory_mb": memory}
        return Seen(dict(c), COMPLETE, figures)

    return run


def drive(space, oracle: Oracle, budget: int) -> list[tuple[dict[str, Any], str]]:
    """Measure the order's moves with ``oracle`` until ``budget`` or until it has none left."""
    seen: list[Seen] = []
    made = []
    for _ in range(budget):
        move = next_move(space, seen)
        if move is None:
            break
        made.append((dict(move.config), move.why))
        seen.append(oracle(move.config))
    return made


def test_a_wall_that_is_no_oom_is_not_called_one():
    # Micro-batches above 8 cannot run (the compiler refuses them, say): the bisection is the
    # same, but the trial line must not say they did not fit.
    def refused_above_8(c: Mapping[str, Any]) -> Seen:
        if c["micro_batch_size"] > 8:
            return Seen(dict(c), FAILED, {})
        return walled(64)(c)

    made = drive(llm_like(batch=(64, 64)), refused_above_8, budget=3)
    assert [c["micro_batch_size"] for c, _ in made] == [64, 4, 16]
    assert made[1][1] == "bisecting the wall: micro-batch 64 failed"
    assert made[2][1] == "bisecting the wall: micro-batch 64 failed, 4 ran"


def test_the_opening_bisects_to_the_oom_wall():
    space = llm_like(batch=(64, 64))
    made = drive(space, walled(8), budget=4)
    micros = [c["micro_batch_size"] for c, _ in made]
    # the largest first, then halfway between what fitted and what did not: 64 x, 4 ok, 16 x, 8 ok
    assert micros == [64, 4, 16, 8]
    assert all(c["precision"] == "bf16" and c["streams"] == 1 for c, _ in made)
    assert not any(c["recompute"] for c, _ in made)
    assert "largest batch and micro-batch" in made[0][1]
    assert "did not fit" in made[1][1]
    # the wall found: fp32 once at half the best micro-batch (is bf16 faster here?), then
    # recompute past the wall: 16 with recompute fits
    seen = [walled(8)(c) for c, _ in made]
    check = next_move(space, seen)
    assert check is not None and check.config["precision"] == "fp32"
    assert check.config["micro_batch_size"] == 4 and "is bf16 faster on this device" in check.why
    after = next_move(space, [*seen, walled(8)(check.config)])
    assert after is not None
    assert after.config["micro_batch_size"] == 16 and after.config["recompute"] is True
    assert "recompute" in after.why


def test_where_the_device_has_no_units_for_the_lower_precision_fp32_takes_over():
    space = llm_like(batch=(8, 8), micro=(1, 8), precisions=("fp32", "bf16"))

    def no_bf16_units(c):  # bf16 matrix products at a twentieth of fp32's speed
        scale = 0.05 if c["precision"] == "bf16" else 1.0
        return scale * 1000.0 * c["micro_batch_size"] / (c["micro_batch_size"] + 0.5)

    made = drive(space, walled(8, no_bf16_units), budget=8)
    assert [c["precision"] for c, _ in made[:2]] == ["bf16", "fp32"]
    # what follows starts from fp32, the fastest
    assert all(c["precision"] == "fp32" for c, _ in made[2:])


def test_where_fp32_wins_at_half_the_micro_batch_the_opening_precision_is_measured_there_too():
    """A device with bf16 units whose caches favour smaller micro-batches: fp32 at micro-batch 4
    beats bf16 at 8 (the first guess) by the micro-batch, not the precision. bf16 at 4 is
    measured next, wins, and the rest of the order starts from it. Where fp32 leads by more than
    ``PRECISION_CLEAR`` (the test above, a twentieth), it is not."""
    space = llm_like(batch=(8, 8), micro=(1, 8), precisions=("fp32", "bf16"))

    def caches(c):  # bf16 1.5x fp32; micro-batch 8 at 0.6x of 4
        scale = 1.5 if c["precision"] == "bf16" else 1.0
        return scale * 1000.0 * (0.6 if c["micro_batch_size"] == 8 else 1.0)

    made = drive(space, walled(8, caches), budget=6)
    assert [(c["precision"], c["micro_batch_size"]) for c, _ in made[:3]] == [
        ("bf16", 8),
        ("fp32", 4),
        ("bf16", 4),
    ]
    assert "bf16 at fp32's micro-batch 4" in made[2][1]
    assert all(c["precision"] == "bf16" for c, _ in made[3:])


def test_the_opening_steps_down_a_batch_when_nothing_fits():
    space = llm_like(batch=(16, 32), micro=(1, 32))

    def oracle(c):  # batch 32 never fits, whatever the micro-batch
        return Seen(dict(c), OOM, {}) if c["batch_size"] == 32 else walled(64)(c)

    made = drive(space, oracle, budget=4)
    # at batch 32: micro-batch 32, then 4 and 1 (bisection down to the smallest), then batch 16
    assert [(c["batch_size"], c["micro_batch_size"]) for c, _ in made] == [
        (32, 32),
        (32, 4),
        (32, 1),
        (16, 16),
    ]


def test_a_precision_that_fails_fidelity_is_passed_over():
    space = llm_like(batch=(8, 8), micro=(1, 8), precisions=("fp32", "tf32", "bf16", "fp16"))

    def oracle(c):
        if c["precision"] in ("bf16", "fp16"):
            return Seen(dict(c), FIDELITY, {})
        return walled(64)(c)

    made = drive(space, oracle, budget=3)
    assert [c["precision"] for c, _ in made] == ["bf16", "fp16", "tf32"]


def test_a_precision_that_failed_only_under_a_lever_is_not_passed_over():
    """bf16 computed the same eagerly and failed the check compiled: the compiler's failure at
    bf16, so the first guess stays in bf16 rather than starting over in fp32."""
    space = llm_like(
        batch=(8, 8), micro=(8, 8), compile={"type": "categorical", "choices": ["off", "default"]}
    )
    eager_bf16 = {"batch_size": 8, "micro_batch_size": 8, "precision": "bf16", "streams": 1,
                  "recompute": False, "compile": "off"}  # fmt: skip
    figures = {"throughput": 100.0, "latency_p95_ms": 80.0, "peak_memory_mb": 50.0}
    seen = [
        Seen(eager_bf16, COMPLETE, figures),
        Seen({**eager_bf16, "compile": "default"}, FIDELITY, {}),
    ]
    assert Book(space, seen, [], {}).precision() == "bf16"
    assert Book(space, seen[1:], [], {}).precision() == "fp32"


def test_the_compiler_opens_off_then_default_then_other_modes_only_where_the_host_bounds_the_step():
    compile_modes = {"type": "categorical", "choices": ["default", "off", "max-autotune"]}
    space = llm_like(batch=(8, 8), micro=(1, 8), precisions=("bf16",), compile=compile_modes)

    def speed(c):  # compiling pays: default 1.5x, max-autotune 1.2x; overhead-bound (m / (m + 4))
        gain = {"off": 1.0, "default": 1.5, "max-autotune": 1.2}[c["compile"]]
        return gain * 1000.0 * c["micro_batch_size"] / (c["micro_batch_size"] + 4)

    made = drive(space, walled(4, speed), budget=10)
    first = made[0]
    assert first[0]["compile"] == "off" and "first guess" in first[1]
    compiled = [(c, why) for c, why in made if c["compile"] != "off"]
    assert compiled[0][0]["compile"] == "default" and "the compiler" in compiled[0][1]
    assert compiled[0][0]["micro_batch_size"] == 4  # at the best so far: the first guess's wall
    # max-autotune once the compiled step was seen to be host-bound (half the micro-batch lost
    # far more than half the throughput), at the best so far, saying why
    autotuned = [(c, why) for c, why in compiled if c["compile"] == "max-autotune"]
    assert len(autotuned) == 1 and "the host bounds the step" in autotuned[0][1]
    assert autotuned[0][0]["micro_batch_size"] == 4
    # what follows starts from the compiled best
    after = made[made.index(compiled[0]) + 1 :]
    assert all(c["compile"] == "default" for c, why in after if "the compiler" not in why)


def test_where_the_step_is_compute_bound_only_the_default_compile_mode_is_tried_by_the_levers():
    compile_modes = {"type": "categorical", "choices": ["off", "default", "max-autotune"]}
    space = llm_like(batch=(8, 8), micro=(1, 8), precisions=("bf16",), compile=compile_modes)

    def speed(c):  # doubling the micro-batch gains next to nothing: compute-bound
        gain = {"off": 1.0, "default": 1.1, "max-autotune": 1.3}[c["compile"]]
        return gain * 1000.0 * c["micro_batch_size"] / (c["micro_batch_size"] + 0.05)

    made = drive(space, walled(4, speed), budget=12)
    levers = [c["compile"] for c, why in made if why.startswith("the compiler")]
    assert levers == ["default"]


def test_nothing_is_measured_twice_and_nothing_certain_to_run_out():
    space = llm_like(batch=(4, 32), micro=(1, 32))
    oracle = walled(8)
    seen: list[Seen] = []
    keys = set()
    while (move := next_move(space, seen)) is not None:
        config = dict(move.config)
        key = tuple(sorted(config.items()))
        assert key not in keys, f"measured twice: {config} ({move.why})"
        keys.add(key)
        ran_out = [s.config for s in seen if s.outcome == OOM]
        assert not any(space.certain_oom(config, r) for r in ran_out), (config, move.why)
        assert space.contains(config)
        seen.append(oracle(config))
    # the order stops only once nothing near the front is left: every feasible configuration
    # that fits is measured or dominated well away from it
    assert len(keys) >= 20


def test_overhead_bound_climbs_to_lanes_and_the_best_is_found_early():
    """Lanes double the speed of micro-batches up to 8: the best is batch 64, micro-batch 8 on
    two lanes, which the expert's guess (micro-batch 64) misses."""
    space = llm_like(batch=(4, 64), micro=(1, 64))

    def speed(c):
        base = 1000.0 * c["micro_batch_size"] / (c["micro_batch_size"] + 8)
        base *= c["batch_size"] / (c["batch_size"] + 4)  # the optimizer step, amortised
        return base * (2.0 if c["streams"] == 2 and c["micro_batch_size"] <= 8 else 1.0)

    oracle = walled(64, speed)
    made = drive(space, oracle, budget=10)
    best = max((oracle(c) for c, _ in made), key=lambda s: s.figures.get("throughput", 0))
    assert best.config["streams"] == 2 and best.config["micro_batch_size"] == 8
    assert best.config["batch_size"] == 64


def test_a_lead_recompute_holds_by_noise_does_not_steer_the_climb():
    """Recompute reads 1% faster everywhere (noise: it adds a forward pass) and nothing needs it
    to fit: the climbs at smaller batches start from the best configuration without it."""
    space = llm_like(batch=(4, 64), micro=(1, 64))
    plain = walled(64)
    oracle = lambda c: Seen(  # noqa: E731
        dict(c),
        COMPLETE,
        {
            **plain(c).figures,
            "throughput": plain(c).figures["throughput"] * (1.01 if c["recompute"] else 1),
        },
    )
    made = drive(space, oracle, budget=40)
    climbs = [
        (c, why)
        for c, why in made
        if why.startswith(("larger micro", "overhead-bound", "more lanes", "smaller micro"))
        and c["batch_size"] < 64
    ]
    assert climbs, "the order climbs at the smaller batches"
    assert climbs[0][0]["recompute"] is False, climbs[0]


def test_another_process_measuring_a_move_is_skipped():
    space = llm_like(batch=(64, 64))
    first = next_move(space, [])
    assert first is not None
    other = next_move(space, [], busy=[first.config])
    assert other is None or other.config != first.config


def test_the_slo_keeps_the_climb_to_batches_that_meet_it():
    space = llm_like(batch=(4, 64), micro=(1, 64))
    oracle = walled(64)
    made = drive(space, oracle, budget=12)
    seen = [oracle(c) for c, _ in made]
    slo = {"latency_p95_ms": 60.0}
    move = next_move(space, seen, slo=slo)
    assert move is not None
    meeting = [s for s in seen if s.figures.get("latency_p95_ms", math.inf) <= 60.0]
    assert meeting, "some measured configuration meets the slo"


# -- the sampler, through Optuna's ask and tell -------------------------------------------------


def run_sampler(space, oracle: Oracle, budget: int, seed: int = 0):
    names = {k: k for k in space.searched}
    seen: list[Seen] = []
    sampler = GuidedSampler(
        space, names, lambda: list(seen), optuna.samplers.TPESampler(seed=seed, multivariate=True)
    )
    study = optuna.create_study(directions=["maximize", "minimize", "minimize"], sampler=sampler)
    configs, whys = [], []
    for _ in range(20 * budget):
        if len(configs) >= budget:
            break
        trial = study.ask()
        config = {k: suggest(trial, k, p) for k, p in space.searched.items()}
        whys.append(study._storage.get_trial(trial._trial_id).user_attrs.get(WHY))
        if space.violations(config) or any(
            {k: v for k, v in s.config.items() if k in config} == config for s in seen
        ):
            study.tell(trial, state=TrialState.PRUNED)
            continue
        outcome = oracle(config)
        seen.append(outcome)
        configs.append(config)
        if outcome.outcome == COMPLETE:
            study.tell(trial, [outcome.figures[m] for m in OBJECTIVES])
        else:
            study.tell(trial, state=TrialState.FAIL)
    return configs, whys


def test_the_sampler_searches_a_workloads_own_knobs_and_floats():
    space = llm_like(
        batch=(8, 8),
        micro=(4, 8),
        precisions=("bf16",),
        width={"type": "categorical", "choices": [64, 128]},
        lr={"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
    )

    def oracle(c):
        seen = walled(64)(c)
        bonus = 1.5 if c["width"] == 128 else 1.0
        return Seen(
            seen.config,
            COMPLETE,
            {**seen.figures, "throughput": seen.figures["throughput"] * bonus},
        )

    configs, whys = run_sampler(space, oracle, budget=12)
    assert len(configs) == 12
    assert {c["width"] for c in configs} == {64, 128}
    assert len({round(c["lr"], 12) for c in configs}) >= 6  # drawn by TPE on every trial
    assert all(1e-4 <= c["lr"] <= 1e-2 for c in configs)
    assert any(w == HANDED_OVER for w in whys), "the order hands over once it has nothing left"


def test_the_sampler_opens_with_the_experts_guess_and_says_why():
    space = llm_like(batch=(4, 32), micro=(1, 32))
    configs, whys = run_sampler(space, walled(64), budget=3)
    assert configs[0] == {
        "batch_size": 32,
        "micro_batch_size": 32,
        "precision": "bf16",
        "streams": 1,
        "recompute": False,
    }
    assert "expert's first guess" in whys[0]
    assert all(whys[:3]) and HANDED_OVER not in whys[:3]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_sampler_never_repeats_a_configuration(seed):
    space = llm_like(batch=(4, 16), micro=(1, 16))
    configs, _ = run_sampler(space, walled(4), budget=40, seed=seed)
    keys = [tuple(sorted(c.items())) for c in configs]
    assert len(keys) == len(set(keys))


RECOMPUTE_SETTINGS = {"type": "categorical", "choices": ["none", "attention", "mlp", "all"]}
"""From the least recomputed to the most, as a space lists them."""


def settings_walled(
    wall: int, keeps: Mapping[str, float], fp32_wall: int | None = None, overhead: float = 4.0
) -> Oracle:
    """Micro-batches above ``wall`` (``fp32_wall`` in fp32) run out of memory; a recompute setting
    that keeps a share ``keeps[setting]`` of the activations lets ``wall / share`` fit. Throughput
    ``m / (m + overhead)``: the smaller ``overhead``, the less a larger micro-batch gains."""

    def run(c: Mapping[str, Any]) -> Seen:
        base = fp32_wall if fp32_wall is not None and c["precision"] == "fp32" else wall
        limit = base / keeps[c["recompute"]] / c["streams"]
        if c["micro_batch_size"] > limit:
            return Seen(dict(c), OOM, {})
        thr = 1000.0 * c["micro_batch_size"] / (c["micro_batch_size"] + overhead)
        figures = {
            "throughput": thr,
            "latency_p95_ms": c["batch_size"] / thr * 1000,
            "peak_memory_mb": 10.0 * c["micro_batch_size"] * keeps[c["recompute"]],
        }
        return Seen(dict(c), COMPLETE, figures)

    return run


def test_the_least_recompute_that_lets_the_micro_batch_at_the_wall_fit_is_tried_in_order():
    space = llm_like(batch=(32, 32), micro=(1, 32), recompute=RECOMPUTE_SETTINGS)
    keeps = {"none": 1.0, "attention": 0.8, "mlp": 0.5, "all": 0.1}
    made = drive(space, settings_walled(8, keeps), budget=8)
    assert [c["recompute"] for c, _ in made[:4]] == ["none"] * 4  # the opening: 32 x, 4, 16 x, 8
    # at micro-batch 16: attention keeps too much (16 > 8 / 0.8), mlp lets it fit; all not tried
    at_wall = [(c["recompute"], why) for c, why in made if c["micro_batch_size"] == 16]
    assert [r for r, _ in at_wall] == ["none", "attention", "mlp"]
    assert "the least recompute not yet tried at micro-batch 16" in at_wall[1][1]
    assert not any(c["recompute"] == "all" and c["micro_batch_size"] == 16 for c, _ in made)


def test_where_a_larger_micro_batch_would_not_pay_for_it_no_recompute_is_tried_past_the_wall():
    """Doubling the micro-batch below the wall (4 to 8) gains 1% where the device is full: less
    than the least recompute costs (``RECOMPUTE_PAYS``), so the wall's probes with recompute, each
    a trial that may run out of memory, are not made. Where it gains 33% (the test above), they
    are."""
    space = llm_like(batch=(32, 32), micro=(1, 32), recompute=RECOMPUTE_SETTINGS)
    keeps = {"none": 1.0, "attention": 0.8, "mlp": 0.5, "all": 0.1}
    made = drive(space, settings_walled(8, keeps, overhead=0.05), budget=8)
    assert not any("the least recompute" in why for _, why in made), made


def compiled_halves_activations(capacity_mb: float, bf16_speed: float = 1.0) -> Oracle:
    """Peak memory 100 MB plus 10 MB a sample eager, 5 compiled; above ``capacity_mb`` out of
    memory. The compiler 1.3x; micro-batch 32 past the peak (0.8x); bf16 ``bf16_speed`` x fp32."""

    def run(c: Mapping[str, Any]) -> Seen:
        per_sample = 10.0 if c["compile"] == "off" else 5.0
        memory = 100.0 + per_sample * c["micro_batch_size"] * c["streams"] * (
            0.4 if c["recompute"] else 1.0
        )
        if memory > capacity_mb:
            return Seen(dict(c), OOM, {})
        micro = c["micro_batch_size"]
        thr = (1.3 if c["compile"] == "default" else 1.0) * micro / (micro + 1)
        thr *= (0.8 if micro == 32 else 1.0) * (bf16_speed if c["precision"] == "bf16" else 1.0)
        figures = {"throughput": thr, "latency_p95_ms": 32 / thr, "peak_memory_mb": memory}
        return Seen(dict(c), COMPLETE, figures)

    return run


COMPILE_MODES = {"type": "categorical", "choices": ["off", "default"]}


def test_memory_a_lever_frees_reopens_the_wall():
    """The compiler holds half the eager step's activations: micro-batch 16, past the eager
    wall, fits compiled. Once the compiler wins at the wall's micro-batch, the micro-batch above
    is tried compiled, predicted from the compiled trial and bf16's fixed part, and fits."""
    space = llm_like(batch=(32, 32), micro=(1, 32), precisions=("bf16",), compile=COMPILE_MODES)
    run = compiled_halves_activations(200.0)
    made = drive(space, run, budget=10)
    won = next(i for i, (c, why) in enumerate(made) if why.startswith("the compiler"))
    config, why = made[won + 1]
    assert (config["compile"], config["micro_batch_size"]) == ("default", 16), made
    assert why.startswith("micro-batch 16 at the best so far, whose levers freed memory: 180 MB")
    assert run(config).outcome == COMPLETE


def test_where_nothing_ran_out_of_memory_no_move_says_memory_was_freed():
    """fp32 wins at half the first guess's micro-batch (bf16 is slow here) and the compiler at
    that: no micro-batch ran out of memory, so there is no wall the compiler re-opened (in the
    default llm run on the CPU such a move read "whose levers freed memory" with no wall)."""
    space = llm_like(batch=(32, 32), micro=(1, 32), compile=COMPILE_MODES)
    made = drive(space, compiled_halves_activations(1000.0, bf16_speed=0.5), budget=10)
    assert any(why.startswith("the compiler") and c["precision"] == "fp32" for c, why in made)
    assert not any("freed memory" in why for _, why in made), made


def test_each_other_precision_bisects_its_own_wall():
    space = llm_like(batch=(32, 32), micro=(1, 32), recompute=RECOMPUTE_SETTINGS)
    keeps = {"none": 1.0, "attention": 0.8, "mlp": 0.5, "all": 0.1}
    oracle = settings_walled(8, keeps, fp32_wall=2)  # bf16's wall is 8; fp32's is 2
    made = drive(space, oracle, budget=10)
    # the fp32 check at half bf16's best micro-batch (4) runs out of memory: fp32's own wall is
    # bisected below it, without recompute
    check = next(c for c, why in made if why.startswith("fp32 at half"))
    assert check["micro_batch_size"] == 4 and oracle(check).outcome == OOM
    walls = [c for c, why in made if "bisecting fp32's own wall" in why]
    assert walls and all(c["micro_batch_size"] < 4 for c in walls)
    assert all(c["precision"] == "fp32" and c["recompute"] == "none" for c in walls)


def test_where_recompute_saves_memory_the_settings_between_fill_the_memory_front():
    space = llm_like(batch=(16, 32), micro=(1, 32), recompute=RECOMPUTE_SETTINGS)
    keeps = {"none": 1.0, "attention": 0.8, "mlp": 0.5, "all": 0.1}
    made = drive(space, settings_walled(64, keeps), budget=40)  # no wall: 32 fits
    front = [(c["recompute"], why) for c, why in made if why.startswith("memory front")]
    settings = [r for r, _ in front]
    # the most recompute at each batch, then the others at the largest batch, most first
    assert settings[:2] == ["all", "all"] and settings[2:] == ["mlp", "attention"]
    assert "between none and all" in front[2][1]


def test_where_recompute_saves_no_memory_no_other_setting_is_tried():
    space = llm_like(batch=(16, 32), micro=(1, 32), recompute=RECOMPUTE_SETTINGS)
    same_memory = {"none": 1.0, "attention": 1.0, "mlp": 1.0, "all": 1.0}
    made = drive(space, settings_walled(64, same_memory), budget=40)
    tried = {c["recompute"] for c, why in made if why.startswith("memory front")}
    assert tried == {"all"}


def test_a_value_between_a_long_ladder_s_ends_steps_to_its_neighbours_without_a_crash():
    """An int knob of more than 4,096 values keeps only its two ends in the book's ladder; a
    value the model-based sampler drew between them must still step up and down (issue 65: a
    suspected ``values.index`` crash, confirmed)."""
    space = parse_space(
        "t",
        {
            "workload": {"_target_": "x"},
            "params": {
                "batch_size": {"type": "int", "low": 8192, "high": 8192},
                "micro_batch_size": {"type": "int", "low": 1, "high": 8192},
            },
            "objectives": OBJECTIVES,
        },
    )
    figures = {"throughput": 100.0, "latency_p95_ms": 1.0, "peak_memory_mb": 1.0}
    seen = [Seen({"batch_size": 8192, "micro_batch_size": m}, COMPLETE, figures) for m in (1, 37)]
    book = Book(space, seen, [], {})
    assert ladder_step(book, "micro_batch_size", 37, +1) == 8192
    assert ladder_step(book, "micro_batch_size", 37, -1) == 1
    assert ladder_step(book, "micro_batch_size", 8192, +1) is None
    next_move(space, seen)  # the order reads the drawn value without failing


def test_a_sweep_twice_clearly_behind_the_best_stops_though_its_own_figures_wobble():
    """On two lanes every micro-batch runs about 30% behind one lane at micro-batch 32, its own
    figures wobbling within their noise (700, 650, 690, ...: never two falls in a row): the sweep
    stops after two steps clearly behind the best, where each more step would cost a compile."""
    space = llm_like(batch=(32, 32), micro=(1, 32), precisions=("bf16",))
    on_two_lanes = {16: 700.0, 8: 650.0, 4: 690.0, 2: 600.0, 1: 500.0}

    def oracle(c: Mapping[str, Any]) -> Seen:
        micro = c["micro_batch_size"]
        thr = on_two_lanes[micro] if c["streams"] == 2 else 1000.0 * micro / 32
        figures = {
            "throughput": thr,
            "throughput_ci_low": thr - 20,
            "throughput_ci_high": thr + 20,
            "latency_p95_ms": 32 / thr * 1000,
            "peak_memory_mb": 10.0 * micro * c["streams"],
        }
        return Seen(dict(c), COMPLETE, figures)

    made = drive(space, oracle, budget=12)
    on_two = [
        c["micro_batch_size"]
        for c, why in made
        if why.startswith("micro-batch sweep") and c["streams"] == 2
    ]
    assert on_two == [16, 8], made


def test_a_memory_budget_is_a_recompute_setting_of_compiled_configurations_alone():
    space = llm_like(
        recompute={"type": "categorical", "choices": ["none", "budget-0.5", "all"]},
        compile={"type": "categorical", "choices": ["off", "default"]},
    )
    book = Book(space, [], [], {})
    assert book.recompute_settings() == ["budget-0.5", "all"]
    assert book.recompute_settings({"compile": "default"}) == ["budget-0.5", "all"]
    assert book.recompute_settings({"compile": "off"}) == ["all"]
