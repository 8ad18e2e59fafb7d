"""Space files drawn from the documented grammar, and mutations of it: each is either a space or
refused with one line (``ConfigError``), never another exception.

The grammar is that of docs/guide/spaces.md: a workload with its ``_target_``, params (``int`` with
``low``/``high``/``step``/``log``/``pow2``, ``float`` with ``low``/``high``/``log``/``step``,
``categorical`` with ``choices``, ``bool``, or a plain fixed value), constraints over knob names,
``memory_grows_with`` and objectives. A mutation puts any YAML value where another was.
"""

from __future__ import annotations

import copy
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from search.config.prepare import load_space
from search.core.errors import ConfigError

CPU = torch.device("cpu")
KNOBS = ["batch_size", "micro_batch_size", "precision", "streams", "recompute", "dropout"]
METRICS = ["throughput", "latency_p50_ms", "latency_p95_ms", "peak_memory_mb", "speed"]

# Any value a YAML file can hold, small.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
yaml_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
numbers = st.one_of(st.integers(-4, 1 << 20), st.floats(-4, 1e6, allow_nan=False))

int_params = st.fixed_dictionaries(
    {"type": st.just("int"), "low": numbers, "high": numbers},
    optional={"step": numbers, "log": st.booleans(), "pow2": st.booleans()},
)
float_params = st.fixed_dictionaries(
    {"type": st.just("float"), "low": numbers, "high": numbers},
    optional={"step": numbers, "log": st.booleans()},
)
categorical_params = st.fixed_dictionaries(
    {
        "type": st.just("categorical"),
        "choices": st.lists(
            st.one_of(st.sampled_from(["fp32", "bf16", "fp16", "tf32"]), st.integers(1, 64)),
            max_size=4,
        ),
    }
)
params = st.one_of(
    int_params,
    float_params,
    categorical_params,
    st.fixed_dictionaries({"type": st.just("bool")}),
    st.integers(1, 16),  # a fixed value
)


def mostly(common: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    """``common`` nine times in ten, ``rare`` the tenth."""
    return st.integers(0, 9).flatmap(lambda i: rare if i == 0 else common)


names = mostly(st.sampled_from(KNOBS[1:]), st.text(min_size=1, max_size=6))


def constraints(knobs: list[str]) -> st.SearchStrategy:
    """Expressions over ``knobs`` (and now and then any text)."""
    expression = st.builds(
        lambda a, op, b: f"{a} {op} {b}",
        st.sampled_from(knobs),
        st.sampled_from(["<=", "<", "==", "!=", "%", "//", "*", "and", "or", ">"]),
        st.one_of(st.sampled_from(knobs), st.integers(0, 64).map(str), st.just("'bf16'")),
    )
    return mostly(expression, st.text(max_size=12))


@st.composite
def spaces(draw) -> dict:
    space = {
        "name": "drawn",
        "workload": {
            "_target_": "search.workloads.GPT",
            "vocab_size": 64,
            "seq_len": 16,
            "d_model": 32,
            "n_layers": 1,
            "n_heads": 2,
        },
        # batch_size (every space needs it) as a small valid range half the time, so that
        # spaces get past the first checks to the later ones (feasibility, constraint probing)
        "params": {
            "batch_size": draw(
                st.one_of(
                    st.builds(
                        lambda low, span, pow2: (
                            {"type": "int", "low": low, "high": low + span}
                            | ({"pow2": True} if pow2 else {})
                        ),
                        st.integers(1, 8),
                        st.integers(0, 64),
                        st.booleans(),
                    ),
                    params,
                )
            ),
            **draw(st.dictionaries(names, params, max_size=3)),
        },
        "constraints": [],
        "objectives": draw(
            st.one_of(
                st.just({"throughput": "maximize", "latency_p95_ms": "minimize"}),
                st.dictionaries(
                    st.sampled_from(METRICS),
                    st.sampled_from(["maximize", "minimize", "up"]),
                    min_size=1,
                    max_size=2,
                ),
            )
        ),
    }
    space["constraints"] = draw(st.lists(constraints(list(space["params"])), max_size=2))
    if draw(st.booleans()):
        space["memory_grows_with"] = draw(st.lists(st.sampled_from(KNOBS), max_size=2))
    return space


@st.composite
def mutated(draw) -> dict:
    """A drawn space with one value, at any depth, replaced by any YAML value."""
    space = copy.deepcopy(draw(spaces()))  # a drawn value may be shared: never change it
    node, path = space, []
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = draw(st.sampled_from([k for k in keys if k != "name"] or keys))
        path.append(key)
        node = node[key]
    if not path:  # any top-level entry but the name, which comes from the file's name
        key = draw(st.sampled_from([k for k in space if k != "name"]))
        space[key] = draw(yaml_values)
        return space
    parent = space
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = draw(yaml_values)
    return space


def loads_or_refuses(raw: dict) -> None:
    try:
        space, notes = load_space(raw, CPU)
    except ConfigError as e:
        text = str(e)
        assert text and "\n" not in text, f"not one line: {text!r}"
        return
    assert space.params and space.objectives
    for value in (p for p in raw["params"].values() if isinstance(p, dict)):
        for bound in ("low", "high"):
            if isinstance(value.get(bound), float):
                assert math.isfinite(value[bound])


SETTINGS = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,  # the same examples in every CI run: a failure is reproducible
)


@SETTINGS
@given(spaces())
def test_a_space_from_the_grammar_loads_or_is_refused_in_one_line(raw):
    loads_or_refuses(raw)


@SETTINGS
@given(mutated())
def test_a_mutated_space_loads_or_is_refused_in_one_line(raw):
    loads_or_refuses(raw)
