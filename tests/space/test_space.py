import copy
import itertools
import random

import pytest

from search.config.compose import compose_config, resolve
from search.core.errors import SpaceError
from search.space.params import CategoricalParam, FixedParam, FloatParam, IntParam
from search.space.parse import parse_space
from search.space.search_space import ENUMERATION_LIMIT, METRIC_DIRECTIONS, Objective

TARGET = "search.workloads.GPT"


def space_dict(params=None, constraints=None, objectives=None, **extra):
    raw = {
        "workload": {"_target_": TARGET, "d_model": 32},
        "params": params if params is not None else {"a": {"type": "int", "low": 0, "high": 3}},
        "objectives": objectives if objectives is not None else {"throughput": "maximize"},
        **extra,
    }
    if constraints is not None:
        raw["constraints"] = constraints
    return raw


def powers_of_two_in(low, high):
    """Brute force: every power of two in [low, high]."""
    return [v for v in range(max(low, 1), high + 1) if v & (v - 1) == 0]


# ---------------------------------------------------------------------------------------------
# Valid spaces


def test_parse_every_param_type():
    raw = space_dict(
        params={
            "stepped": {"type": "int", "low": 1, "high": 10, "step": 3},
            "logint": {"type": "int", "low": 1, "high": 1000, "log": True},
            "pow2": {"type": "int", "low": 3, "high": 40, "pow2": True},
            "lr": {"type": "float", "low": 1.0e-4, "high": 1.0e-2, "log": True},
            "dropout": {"type": "float", "low": 0, "high": 1},
            "precision": {"type": "categorical", "choices": ["fp32", "bf16"]},
            "recompute": {"type": "bool"},
            "streams": 1,
            "mode": "eager",
        },
        constraints=["stepped <= pow2"],
        objectives={"throughput": "maximize", "latency_p95_ms": "minimize"},
        description="a test space",
    )
    space = parse_space("every", raw)

    assert space.name == "every"
    assert space.workload == {"_target_": TARGET, "d_model": 32}
    p = space.params
    assert p["stepped"] == IntParam(low=1, high=10, step=3)
    assert p["stepped"].values() == [1, 4, 7, 10]
    # tenths end a range exactly, as Optuna's check of the same rule reads them
    tenths = parse_space("t", _param({"type": "float", "low": 0.0, "high": 0.3, "step": 0.1}))
    assert tenths.params["x"] == FloatParam(0.0, 0.3, False, 0.1)
    assert p["logint"] == IntParam(low=1, high=1000, log=True)
    assert p["logint"].values() == list(range(1, 1001))
    assert p["pow2"] == IntParam(low=3, high=40, pow2=True)
    assert p["pow2"].values() == [4, 8, 16, 32]
    assert p["lr"] == FloatParam(1.0e-4, 1.0e-2, log=True)
    assert p["lr"].values() is None
    assert p["dropout"] == FloatParam(0.0, 1.0)
    assert isinstance(p["dropout"].low, float)
    assert p["precision"] == CategoricalParam(("fp32", "bf16"))
    assert p["recompute"] == CategoricalParam((False, True))
    assert p["streams"] == FixedParam(1)
    assert p["mode"] == FixedParam("eager")

    assert list(space.searched) == [
        "stepped",
        "logint",
        "pow2",
        "lr",
        "dropout",
        "precision",
        "recompute",
    ]
    assert space.fixed == {"streams": 1, "mode": "eager"}
    assert [c.text for c in space.constraints] == ["stepped <= pow2"]
    assert space.objectives == (
        Objective("throughput", "maximize"),
        Objective("latency_p95_ms", "minimize"),
    )


def test_parse_does_not_alias_the_input_workload():
    raw = space_dict()
    space = parse_space("t", raw)
    raw["workload"]["d_model"] = 999
    assert space.workload["d_model"] == 32


def test_constraints_are_optional():
    assert parse_space("t", space_dict()).constraints == ()
    raw = space_dict()
    raw["constraints"] = None
    assert parse_space("t", raw).constraints == ()


def test_int_pow2_values_example():
    assert IntParam(low=3, high=40, pow2=True).values() == [4, 8, 16, 32]


def test_int_pow2_values_match_brute_force():
    for low in range(1, 70):
        for high in range(low, 140):
            param = IntParam(low=low, high=high, pow2=True)
            assert param.values() == powers_of_two_in(low, high), (low, high)


def test_int_pow2_values_exact_for_large_bounds():
    assert IntParam(low=2**50 + 1, high=2**51 - 1, pow2=True).values() == []
    assert IntParam(low=2**53 - 1, high=2**53 - 1, pow2=True).values() == []


# ---------------------------------------------------------------------------------------------
# Invalid spaces: (id, raw space, fragments the message must contain)


def _with(**changes):
    raw = space_dict()
    raw.update(changes)
    return raw


def _param(spec, name="x"):
    return space_dict(params={name: spec, "a": {"type": "int", "low": 0, "high": 3}})


INVALID = [
    ("not_a_mapping", ["workload", "params"], ["expected a mapping"]),
    (
        "missing_target",
        _with(workload={"d_model": 8}),
        ["workload._target_", "must name the workload class"],
    ),
    (
        "workload_not_mapping",
        _with(workload="search.workloads.GPT"),
        ["workload._target_", "must name"],
    ),
    ("target_not_string", _with(workload={"_target_": 3}), ["workload._target_", "must name"]),
    (
        "missing_params",
        {k: v for k, v in space_dict().items() if k != "params"},
        ["params", "at least one knob"],
    ),
    ("empty_params", _with(params={}), ["params", "at least one knob"]),
    (
        "unknown_top_level_key",
        _with(objective={"throughput": "maximize"}),
        ["'objective'", "allowed: workload, params"],
    ),
    (
        "unknown_param_type",
        _param({"type": "integer", "low": 1, "high": 2}),
        ["params.x", "type must be one of int, float, categorical, bool", "'integer'"],
    ),
    ("mapping_without_type", _param({"low": 1, "high": 2}), ["params.x", "type must be one of"]),
    (
        "unknown_key_for_float",
        _param({"type": "float", "low": 1, "high": 2, "pow2": True}),
        ["params.x", "'pow2'", "for type float", "allowed"],
    ),
    (
        "unknown_key_for_bool",
        _param({"type": "bool", "choices": [True]}),
        ["params.x", "'choices'", "for type bool"],
    ),
    (
        "unknown_key_for_categorical",
        _param({"type": "categorical", "choices": [1], "low": 0}),
        ["params.x", "'low'", "for type categorical"],
    ),
    (
        "empty_choices",
        _param({"type": "categorical", "choices": []}),
        ["params.x", "choices must be a non-empty list"],
    ),
    (
        "choices_not_a_list",
        _param({"type": "categorical", "choices": "fp32,bf16"}),
        ["params.x", "non-empty list"],
    ),
    (
        "duplicate_choices",
        _param({"type": "categorical", "choices": ["fp32", "bf16", "fp32"]}),
        ["params.x", "choices must be distinct"],
    ),
    (
        "low_above_high",
        _param({"type": "int", "low": 8, "high": 4}),
        ["params.x", "`low <= high` must hold", "low=8, high=4"],
    ),
    (
        "float_low_above_high",
        _param({"type": "float", "low": 1.0, "high": 0.5}),
        ["params.x", "`low <= high`"],
    ),
    (
        "non_int_low_for_int",
        _param({"type": "int", "low": 1.5, "high": 4}),
        ["params.x", "low must be an int", "1.5"],
    ),
    (
        "bool_high_for_int",
        _param({"type": "int", "low": 0, "high": True}),
        ["params.x", "high must be an int"],
    ),
    (
        "missing_high",
        _param({"type": "int", "low": 0}),
        ["params.x", "high must be an int", "None"],
    ),
    # YAML 1.1 (PyYAML) reads `1e-3` as a string
    (
        "string_low_for_float",
        _param({"type": "float", "low": "1e-3", "high": 1.0}),
        ["params.x", "low must be a finite number"],
    ),
    (
        "float_log_low_zero",
        _param({"type": "float", "low": 0.0, "high": 1.0, "log": True}),
        ["params.x", "log scale needs `low > 0`"],
    ),
    (
        "int_log_low_negative",
        _param({"type": "int", "low": -2, "high": 8, "log": True}),
        ["params.x", "log scale needs `low > 0`", "low=-2"],
    ),
    (
        "pow2_empty_range",
        _param({"type": "int", "low": 5, "high": 7, "pow2": True}),
        ["params.x", "no power of two", "[5, 7]"],
    ),
    (
        "pow2_with_step",
        _param({"type": "int", "low": 1, "high": 16, "step": 2, "pow2": True}),
        ["params.x", "pow2 needs", "no step"],
    ),
    (
        "pow2_low_zero",
        _param({"type": "int", "low": 0, "high": 16, "pow2": True}),
        ["params.x", "pow2 needs low >= 1"],
    ),
    (
        "step_zero",
        _param({"type": "int", "low": 1, "high": 8, "step": 0}),
        ["params.x", "step must be a positive int"],
    ),
    (
        "step_fraction",
        _param({"type": "int", "low": 1, "high": 8, "step": 1.5}),
        ["params.x", "step must be a positive int"],
    ),
    (
        "float_step_zero",
        _param({"type": "float", "low": 0.0, "high": 1.0, "step": 0}),
        ["params.x", "step"],
    ),
    (
        "float_step_string",
        _param({"type": "float", "low": 0.0, "high": 1.0, "step": "x"}),
        ["params.x", "step"],
    ),
    (
        "int_step_past_high",
        _param({"type": "int", "low": 8, "high": 20, "step": 8}),
        ["params.x", "high must be low plus a whole number of steps", "write high: 16"],
    ),
    (
        "float_step_past_high",
        _param({"type": "float", "low": 0.0, "high": 0.25, "step": 0.1}),
        ["params.x", "low=0.0, high=0.25, step=0.1", "write high: 0.2"],
    ),
    (
        "float_step_with_log",
        _param({"type": "float", "low": 1e-3, "high": 1.0, "step": 0.1, "log": True}),
        ["params.x", "step"],
    ),
    (
        "int_step_with_log",
        _param({"type": "int", "low": 1, "high": 64, "step": 2, "log": True}),
        ["params.x", "step"],
    ),
    (
        "constraint_not_string",
        _with(constraints=[5]),
        ["constraints", "must be an expression string", "5"],
    ),
    (
        "constraint_is_mapping",
        _with(constraints=[{"a": 1}]),
        ["constraints", "must be an expression string"],
    ),
    (
        "constraint_syntax_error",
        _with(constraints=["a <"]),
        ["constraints", "cannot parse", "'a <'"],
    ),
    (
        "constraint_unknown_knob",
        _with(constraints=["a <= bacth_size"]),
        ["constraints", "unknown knob 'bacth_size'", "knobs: a", "space.params.bacth_size=1"],
    ),
    (
        "constraint_misspelt_knob",
        _with(constraints=["aa <= 4"]),
        ["constraints", "unknown knob 'aa'", "did you mean 'a'?"],
    ),
    (
        "constraint_function_call",
        _with(constraints=["__import__('os').system('x')"]),
        ["constraints", "uses Call", "do not allow"],
    ),
    ("constraint_builtin_call", _with(constraints=["abs(a) > 1"]), ["constraints", "uses Call"]),
    (
        "constraint_attribute",
        _with(constraints=["a.real > 1"]),
        ["constraints", "uses Attribute", "do not allow"],
    ),
    (
        "constraint_lambda",
        _with(constraints=["(lambda: 1)() == 1"]),
        ["constraints", "do not allow"],
    ),
    ("constraint_bare_lambda", _with(constraints=["lambda: a"]), ["constraints", "uses Lambda"]),
    (
        "constraint_comprehension",
        _with(constraints=["[a for a in (1, 2)]"]),
        ["constraints", "uses ListComp"],
    ),
    (
        "constraint_generator",
        _with(constraints=["any(a for a in (1,))"]),
        ["constraints", "do not allow"],
    ),
    ("constraint_subscript", _with(constraints=["a[0] == 1"]), ["constraints", "uses Subscript"]),
    ("constraint_walrus", _with(constraints=["(a := 1) == a"]), ["constraints", "uses NamedExpr"]),
    ("constraint_conditional", _with(constraints=["1 if a else 0"]), ["constraints", "uses IfExp"]),
    (
        "constraint_no_condition",
        _with(constraints=["a"]),
        ["constraints", "'a' is no condition", "compare it"],
    ),
    (
        "constraint_arithmetic_only",
        _with(constraints=["a - 2 or a > 1"]),
        ["constraints", "is no condition"],
    ),
    (
        "unknown_objective_metric",
        _with(objectives={"tput": "maximize"}),
        ["objectives", "unknown metric 'tput'", "known: " + ", ".join(METRIC_DIRECTIONS)],
    ),
    (
        "bad_direction",
        _with(objectives={"throughput": "max"}),
        ["objectives.throughput", "must be maximize or minimize", "'max'"],
    ),
    (
        "opposite_direction",
        _with(objectives={"throughput": "minimize"}),
        ["objectives.throughput", "should be maximize", "minimize"],
    ),
    (
        "opposite_direction_latency",
        _with(objectives={"latency_p95_ms": "maximize"}),
        ["objectives.latency_p95_ms", "should be minimize"],
    ),
    (
        "empty_objectives",
        _with(objectives={}),
        ["objectives must map metric names", "maximize/minimize"],
    ),
    ("objectives_as_list", _with(objectives=["throughput"]), ["objectives must map"]),
]


def _case(case):
    return case if hasattr(case, "marks") else pytest.param(*case, id=case[0])


@pytest.mark.parametrize("case_id, raw, fragments", [_case(c) for c in INVALID])
def test_invalid_space_is_rejected_with_a_message_that_says_what_to_fix(case_id, raw, fragments):
    with pytest.raises(SpaceError) as info:
        parse_space("bad", copy.deepcopy(raw))
    message = str(info.value)
    assert message.startswith("space 'bad': ")
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_space_error_is_a_value_error():
    assert issubclass(SpaceError, ValueError)


# ---------------------------------------------------------------------------------------------
# Constraint evaluation

KNOBS = {
    "a": {"type": "int", "low": 0, "high": 4},
    "b": {"type": "int", "low": 0, "high": 4},
    "precision": {"type": "categorical", "choices": ["fp32", "bf16", "fp16"]},
    "streams": {"type": "int", "low": 1, "high": 2},
    "flag": {"type": "bool"},
}

EXPRESSIONS = [
    "a + b * 2 - 1 >= 3",
    "a * a == b",
    "-a < b",
    "+a == b",
    "(a + 1) * (b + 1) > 6",
    "1 < a <= b < 4",
    "0 <= a < b != 3",
    "a == b == 2",
    "a > 1 and b > 1",
    "a > 3 or b < 1",
    "not a > 2",
    "not (a > 1 and b > 1) or streams == 2",
    "precision != 'fp16' or streams == 1",
    "precision == 'bf16' and not flag",
    "precision < 'c'",
    "flag or a == 0",
    "b != 0 and a / b >= 1.5",
    "b == 0 or a // b == 1",
    "b == 0 or a % b == 0",
]


def _knob_grid():
    names = list(KNOBS)
    lists = [range(5), range(5), ["fp32", "bf16", "fp16"], [1, 2], [False, True]]
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*lists)]


@pytest.mark.parametrize("expression", EXPRESSIONS)
def test_constraint_agrees_with_python_on_every_config(expression):
    (constraint,) = parse_space("t", space_dict(params=KNOBS, constraints=[expression])).constraints
    results = []
    for config in _knob_grid():
        expected = bool(eval(expression, {"__builtins__": {}}, dict(config)))
        assert constraint.holds(config) is expected, config
        results.append(expected)
    assert any(results) and not all(results)  # the expression discriminates, so the test can fail


def test_string_comparison_constraint():
    space = parse_space(
        "t", space_dict(params=KNOBS, constraints=["precision != 'fp16' or streams == 1"])
    )
    base = {"a": 1, "b": 1, "flag": False}
    assert space.violations({**base, "precision": "fp16", "streams": 1}) == []
    assert space.violations({**base, "precision": "bf16", "streams": 2}) == []
    assert space.violations({**base, "precision": "fp16", "streams": 2}) == [
        "precision != 'fp16' or streams == 1"
    ]


def test_violations_lists_each_broken_constraint():
    texts = ["a <= b", "a + b < 5", "streams == 1"]
    space = parse_space("t", space_dict(params=KNOBS, constraints=texts))
    config = {"a": 4, "b": 3, "precision": "fp32", "streams": 2, "flag": True}
    assert space.violations(config) == texts
    assert space.violations({**config, "a": 1, "streams": 1}) == []


@pytest.mark.parametrize(
    "expression", ["a / b == 2", "a / b > 0", "a // b >= 0", "a % b == 0", "a / b < 100"]
)
def test_zero_divisor_makes_constraint_fail_instead_of_raising(expression):
    (constraint,) = parse_space("t", space_dict(params=KNOBS, constraints=[expression])).constraints
    config = {"a": 4, "b": 0, "precision": "fp32", "streams": 1, "flag": False}
    assert constraint.holds(config) is False
    # the same expression holds with a non-zero divisor
    assert constraint.holds({**config, "b": 2}) is True


# "a % b != 0", not the bare "a % b": a bare number is no condition (refused when parsed)
@pytest.mark.parametrize(
    "expression", ["a / b != 2", "not a % b == 1", "a % b != 0", "not a // b < 1"]
)
def test_zero_divisor_fails_constraint_even_when_negated(expression):
    (constraint,) = parse_space("t", space_dict(params=KNOBS, constraints=[expression])).constraints
    assert (
        constraint.holds({"a": 4, "b": 0, "precision": "fp32", "streams": 1, "flag": False})
        is False
    )


# ---------------------------------------------------------------------------------------------
# Enumeration and sampling


@pytest.fixture(scope="module")
def llm_cpu_raw():
    cfg = compose_config(["+space=llm", "preset=cpu", "device=cpu"])
    return resolve(cfg)["space"]


def _raw_values(spec):
    """A param's values from its raw spec, computed without search.space's own parsing."""
    if not isinstance(spec, dict):
        return [spec]
    if spec["type"] == "bool":
        return [False, True]
    if spec["type"] == "categorical":
        return list(spec["choices"])
    assert spec["type"] == "int"
    if spec.get("pow2"):
        return powers_of_two_in(spec["low"], spec["high"])
    return list(range(spec["low"], spec["high"] + 1, spec.get("step", 1)))


def test_feasible_configs_of_llm_cpu_match_brute_force(llm_cpu_raw):
    assert llm_cpu_raw["constraints"] == [
        "batch_size % micro_batch_size == 0",
        "streams <= batch_size // micro_batch_size",
    ], "llm.yaml's constraints changed: update the Python version of them below"

    def feasible(c):
        return (
            c["batch_size"] % c["micro_batch_size"] == 0
            and c["streams"] <= c["batch_size"] // c["micro_batch_size"]
        )

    names = list(llm_cpu_raw["params"])
    lists = [_raw_values(llm_cpu_raw["params"][n]) for n in names]
    everything = [dict(zip(names, combo, strict=True)) for combo in itertools.product(*lists)]
    expected = [c for c in everything if feasible(c)]
    assert 0 < len(expected) < len(everything)

    actual = parse_space("llm", llm_cpu_raw).feasible_configs()
    assert actual is not None
    key = lambda c: tuple(repr(c[n]) for n in names)  # noqa: E731
    assert len(actual) == len(expected)
    assert sorted(map(key, actual)) == sorted(map(key, expected))


def test_feasible_configs_include_fixed_params():
    space = parse_space(
        "t",
        space_dict(
            params={"a": {"type": "int", "low": 0, "high": 3}, "streams": 2},
            constraints=["a < streams"],
        ),
    )
    assert space.feasible_configs() == [{"a": 0, "streams": 2}, {"a": 1, "streams": 2}]


def test_feasible_configs_is_none_for_a_float_param():
    space = parse_space(
        "t",
        space_dict(
            params={
                "a": {"type": "int", "low": 0, "high": 3},
                "lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
            }
        ),
    )
    assert space.feasible_configs() is None


def test_feasible_configs_is_none_above_the_enumeration_limit():
    side = int(ENUMERATION_LIMIT**0.5) + 1
    space = parse_space(
        "t",
        space_dict(
            params={
                "a": {"type": "int", "low": 1, "high": side},
                "b": {"type": "int", "low": 1, "high": side},
            }
        ),
    )
    assert space.feasible_configs() is None


def test_feasible_configs_empty_when_unsatisfiable():
    space = parse_space("t", space_dict(constraints=["a > 10"]))
    assert space.feasible_configs() == []


def test_random_feasible_returns_only_feasible_configs():
    space = parse_space(
        "t",
        space_dict(
            params={
                **KNOBS,
                "lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
                "wd": {"type": "float", "low": 0.0, "high": 0.5},
                "seed": 7,
            },
            constraints=["a + b >= 5", "precision != 'fp16' or streams == 1", "lr * 100 < 0.5"],
        ),
    )
    rng = random.Random(1234)
    seen = set()
    for _ in range(200):
        config = space.random_feasible(rng)
        assert config is not None
        assert set(config) == set(space.params)
        assert space.violations(config) == []
        assert config["a"] + config["b"] >= 5 and (
            config["precision"] != "fp16" or config["streams"] == 1
        )
        assert 1e-4 <= config["lr"] < 5e-3 and 0.0 <= config["wd"] <= 0.5
        assert config["seed"] == 7
        assert (
            config["a"] in range(5) and config["b"] in range(5) and config["flag"] in (False, True)
        )
        seen.add((config["a"], config["b"], config["precision"], config["streams"], config["flag"]))
    assert len(seen) > 10  # it explores, not one fixed answer


def test_feasible_sample_holds_each_knobs_ends_where_they_are_feasible():
    # What the checks before a study read of a space with a float knob: each value the workload
    # might not take must be among it, and nothing infeasible.
    params = {**KNOBS, "lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}}
    space = parse_space("t", space_dict(params=params, constraints=["a + b >= 4"]))
    assert space.feasible_configs() is None
    sample = space.feasible_sample(random.Random(0))
    assert sample and all(space.violations(c) == [] for c in sample)
    for name, ends in [("a", {0, 4}), ("b", {0, 4}), ("lr", {1e-4, 1e-2}), ("flag", {False, True})]:
        assert ends <= {c[name] for c in sample}, name
    assert {c["precision"] for c in sample} == set(params["precision"]["choices"])


def test_feasible_sample_holds_the_ends_of_a_knob_listed_first_where_the_corners_are_cut():
    # 2 * 2**10 corners: the first 512 of their product all take `width` at its low end.
    params = {
        "width": {"type": "int", "low": 1, "high": 1000},
        **{f"flag{i}": {"type": "bool"} for i in range(10)},
    }
    space = parse_space("t", space_dict(params=params, constraints=[]))
    sample = space.feasible_sample(random.Random(0), draws=0)
    assert {c["width"] for c in sample} == {1, 1000}
    assert all({c[f"flag{i}"] for c in sample} == {False, True} for i in range(10))


def test_random_feasible_is_reproducible_with_the_same_seed():
    space = parse_space("t", space_dict(params=KNOBS, constraints=["a < b"]))
    first = [space.random_feasible(random.Random(5)) for _ in range(3)]
    assert first[0] == first[1] == first[2]


def test_random_feasible_is_none_when_unsatisfiable():
    space = parse_space("t", space_dict(params=KNOBS, constraints=["a > b", "b > a"]))
    assert space.random_feasible(random.Random(0)) is None


# ---------------------------------------------------------------------------------------------
# Narrowing choices


def test_without_choices_drops_rejected_choices_with_a_note():
    space = parse_space(
        "t",
        space_dict(
            params={
                "precision": {"type": "categorical", "choices": ["fp32", "tf32", "bf16", "fp16"]},
                "recompute": {"type": "bool"},
                "a": {"type": "int", "low": 0, "high": 3},
                "streams": 1,
            }
        ),
    )
    calls = []

    def reject(name, value):
        calls.append((name, value))
        if name == "precision" and value in ("tf32", "fp16"):
            return f"{value} needs CUDA"
        return None

    narrowed, notes = space.without_choices(reject)
    assert narrowed.params["precision"] == CategoricalParam(("fp32", "bf16"))
    assert narrowed.params["recompute"] == space.params["recompute"]
    assert narrowed.params["a"] == space.params["a"] and narrowed.params["streams"] == FixedParam(1)
    assert notes == [
        "precision=tf32 dropped: tf32 needs CUDA",
        "precision=fp16 dropped: fp16 needs CUDA",
    ]
    # the original is unchanged
    assert space.params["precision"].choices == (
        "fp32",
        "tf32",
        "bf16",
        "fp16",
    )
    assert ("recompute", False) in calls and ("recompute", True) in calls
    # only categorical knobs are asked about
    assert not any(name in ("a", "streams") for name, _ in calls)
    assert narrowed.constraints == space.constraints and narrowed.objectives == space.objectives


def test_without_choices_keeps_everything_when_nothing_is_rejected():
    space = parse_space("t", space_dict(params=KNOBS))
    narrowed, notes = space.without_choices(lambda name, value: None)
    assert notes == []
    assert narrowed.params == space.params


def test_without_choices_raises_when_no_choice_is_left():
    space = parse_space(
        "t",
        space_dict(
            params={
                "a": {"type": "int", "low": 0, "high": 3},
                "precision": {"type": "categorical", "choices": ["tf32", "fp16"]},
            }
        ),
    )
    with pytest.raises(SpaceError) as info:
        space.without_choices(lambda name, value: "needs CUDA" if name == "precision" else None)
    message = str(info.value)
    assert "space 't'" in message and "params.precision" in message
    assert "every choice is unusable" in message
    assert (
        "precision=tf32 dropped: needs CUDA" in message
        and "precision=fp16 dropped: needs CUDA" in message
    )


def test_power_operator_is_not_allowed():
    # a ** b could be made to hang the evaluator (10 ** 10 ** 10), so constraints cannot use it
    with pytest.raises(SpaceError, match="uses Pow"):
        parse_space("t", space_dict(params=KNOBS, constraints=["a ** 2 == b"]))


def test_type_mismatch_in_a_constraint_is_a_space_error_not_a_crash():
    (constraint,) = parse_space(
        "t", space_dict(params=KNOBS, constraints=["precision * 2 > 1"])
    ).constraints
    with pytest.raises(SpaceError, match="cannot be evaluated"):
        constraint.holds({"a": 1, "b": 1, "precision": "fp32", "streams": 1, "flag": False})


@pytest.mark.parametrize("flag", ["log", "pow2"])
def test_flags_must_be_booleans(flag):
    with pytest.raises(SpaceError, match=f"{flag} must be true or false"):
        parse_space("t", space_dict(params={"x": {"type": "int", "low": 1, "high": 8, flag: "no"}}))


def test_a_huge_integer_range_is_never_materialised():
    """A billion values: parsing, membership, counting and drawing work by arithmetic."""
    import time

    started = time.monotonic()
    space = parse_space(
        "huge",
        space_dict(
            {
                "batch_size": {"type": "int", "low": 1, "high": 1_000_000_000},
                "w": {"type": "int", "low": 0, "high": 10**12, "step": 4},
            }
        ),
    )
    assert space.contains({"batch_size": 999_999_999, "w": 8})
    assert not space.contains({"batch_size": 1_000_000_001, "w": 8})
    assert not space.contains({"batch_size": 5, "w": 6})  # off the step
    assert space.feasible_configs() is None  # too many to list
    config = space.random_feasible(random.Random(0))
    assert config is not None and space.contains(config)
    assert space.params["batch_size"].count() == 1_000_000_000
    assert time.monotonic() - started < 2.0


def test_a_knob_fixed_by_an_override_leaves_memory_grows_with():
    raw = {
        "workload": {"_target_": "x"},
        "params": {"batch_size": 8, "micro_batch_size": {"type": "int", "low": 1, "high": 8}},
        "memory_grows_with": ["batch_size", "micro_batch_size"],
        "objectives": {"throughput": "maximize"},
    }
    space = parse_space("t", raw)
    assert space.memory_grows_with == ("micro_batch_size",)
    # Still certain: a larger micro-batch at the same fixed batch runs out as well.
    assert space.certain_oom(
        {"batch_size": 8, "micro_batch_size": 8}, {"batch_size": 8, "micro_batch_size": 4}
    )
