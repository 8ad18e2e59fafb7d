"""The knob registry and everything that lists knobs agree: a knob added in one place only fails
here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from search.core.knob_registry import GENERIC_KNOBS, KNOBS, NUMERIC_KNOBS, SHORT_LABELS, TASKS, Knob
from search.core.records import config_name
from search.execution.knobs import Knobs, knobs_off_default, unsupported_reason, value_rule
from search.workloads.base import SERVE_KNOBS, TRAIN_KNOBS, ServingWorkload, Workload


def test_the_registry_holds_each_knob_once_with_known_tasks():
    assert len(set(GENERIC_KNOBS)) == len(KNOBS)
    assert len(set(SHORT_LABELS.values())) == len(SHORT_LABELS)
    for knob in KNOBS:
        assert knob.tasks and set(knob.tasks) <= set(TASKS), knob.name
        assert knob.description.strip(), knob.name
    with pytest.raises(TypeError):
        Knob("batch_size", "bs", ("train",), False, "positional")  # type: ignore[misc]


def test_every_knob_is_a_field_of_knobs_in_the_same_order():
    assert tuple(f.name for f in dataclasses.fields(Knobs)) == GENERIC_KNOBS


def test_every_knob_but_batch_size_has_a_default_the_plain_step_runs():
    optional = [name for name in GENERIC_KNOBS if name != "batch_size"]
    assert knobs_off_default(Knobs(batch_size=4), optional) == []


def test_the_workload_knob_lists_are_the_registry_per_task():
    assert TRAIN_KNOBS == Workload.knobs == tuple(k.name for k in KNOBS if "train" in k.tasks)
    assert (
        SERVE_KNOBS == ServingWorkload.knobs == tuple(k.name for k in KNOBS if "serve" in k.tasks)
    )


def test_a_configuration_label_abbreviates_the_knobs_with_a_short_label():
    config = {"batch_size": 32, "micro_batch_size": 8, "precision": "bf16", "streams": 2}
    assert config_name(config) == "bs32·mb8·bf16·s2"
    for knob in KNOBS:
        label = config_name({knob.name: 3})
        assert label == (f"{knob.short}3" if knob.short else f"{knob.name}=3"), knob.name


@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: k.name)
def test_every_knob_has_a_value_rule_and_a_device_check(knob):
    valid, expected = value_rule(knob.name)
    default = next(f.default for f in dataclasses.fields(Knobs) if f.name == knob.name)
    assert default is dataclasses.MISSING or default is None or valid(default), expected
    assert unsupported_reason(knob.name, default, torch.device("cpu")) is None


def test_the_knobs_that_change_numerics_set_a_step_apart_from_the_plain_one():
    plain = Knobs(batch_size=8)
    assert plain.numerics_apart_from(plain) == ()
    changed = Knobs(batch_size=8, micro_batch_size=4, precision="bf16", streams=2, recompute=True)
    assert changed.numerics_apart_from(plain) == (
        "micro_batch_size",
        "precision",
        "streams",
        "recompute",
    )
    assert set(changed.numerics_apart_from(plain)) <= set(NUMERIC_KNOBS)
    # micro_batch_size as it runs: None is one micro-batch of the whole batch
    assert Knobs(batch_size=8, micro_batch_size=8).numerics_apart_from(plain) == ()
