"""The typed settings (search.config.settings), checked when the config is composed."""

import ast
import dataclasses
import inspect
import textwrap
import typing

import pytest
import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from search.config.compose import (
    CONF_DIR,
    SCHEMA_NAME,
    ConfigError,
    compose_config,
    load_settings,
    resolve,
)
from search.config.settings import (
    NoiseSettings,
    RevalidateSettings,
    RunnerSettings,
    Settings,
    StableSettings,
    StudySettings,
    TrackingSettings,
)
from search.measurement.protocol import MeasureSettings


def _one_line_error(override: str) -> str:
    with pytest.raises(ConfigError) as info:
        compose_config(["+space=llm", "device=cpu", override])
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message and message.strip() == message
    return message


# ---------------------------------------------------------------------------------------------
# Bad values fail at composition, with one line naming the key


NOT_FINITE = [
    ("stable.max_cv=nan", "stable.max_cv"),
    ("stable.max_cv=inf", "stable.max_cv"),
    ("stable.alpha=nan", "stable.alpha"),
    ("stable.excess_cv=inf", "stable.excess_cv"),
    ("noise.budget=nan", "noise.budget"),
    ("study.timeout_s=inf", "study.timeout_s"),
    ("study.timeout_s=nan", "study.timeout_s"),
    ("study.max_failure_rate=nan", "study.max_failure_rate"),
    ("runner.timeout_s=inf", "runner.timeout_s"),
    ("runner.timeout_s=nan", "runner.timeout_s"),
    ("runner.memory_limit_mb=inf", "runner.memory_limit_mb"),
    ("runner.memory_limit_mb=nan", "runner.memory_limit_mb"),
    ("measure.warmup_s=inf", "measure.warmup_s"),
    ("measure.window_s=inf", "measure.window_s"),
    ("measure.window_s=nan", "window_s"),  # MeasureSettings' own check, which names its fields
    ("measure.target_rel_ci=inf", "measure.target_rel_ci"),
    ("measure.max_time_s=inf", "measure.max_time_s"),
    ("measure.confidence=nan", "confidence"),
    ("+slo.latency_p95_ms=nan", "slo.latency_p95_ms"),
    ("+slo.latency_p95_ms=inf", "slo.latency_p95_ms"),
    ("revalidate.max_time_s=inf", "revalidate.max_time_s"),
]


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_repeat_budget_that_is_not_positive_is_refused(value):
    message = _one_line_error(f"revalidate.max_time_s={value}")
    assert "revalidate.max_time_s must be a positive number of seconds" in message


@pytest.mark.parametrize("override, key", NOT_FINITE, ids=[o for o, _ in NOT_FINITE])
def test_nan_and_inf_are_refused(override, key):
    message = _one_line_error(override)
    assert key in message
    assert "nan" in message or "inf" in message  # says what was received


def test_negative_seed_is_refused():
    message = _one_line_error("seed=-1")
    assert "seed must be an integer from 0 to 2147483647" in message and "-1" in message


@pytest.mark.parametrize("override", ["slo=3", "slo=abc", "slo=null", "slo=[1]"])
def test_slo_that_is_not_a_mapping_is_refused(override):
    message = _one_line_error(override)
    assert message.startswith("slo must be a mapping of metric name to limit")
    assert "+slo.latency_p95_ms=200" in message  # says how to write one


WRONG_TYPE = [
    ("seed=abc", "seed must be an integer, but got 'abc'"),
    ("seed=2.5", "seed must be an integer, but got 2.5"),
    ("study.n_trials=abc", "study.n_trials must be an integer, but got 'abc'"),
    ("study.n_trials=[1]", "study.n_trials must be an integer"),
    ("study.heartbeat_s=fast", "study.heartbeat_s must be an integer"),
    ("study.timeout_s=soon", "study.timeout_s must be a number or null, but got 'soon'"),
    ("study.max_failure_rate=most", "study.max_failure_rate must be a number"),
    ("runner.timeout_s=long", "runner.timeout_s must be a number or null"),
    (
        "runner.memory_limit_mb=8GB",
        "runner.memory_limit_mb must be a number or null, but got '8GB'",
    ),
    ("stable.max_cv=abc", "stable.max_cv must be a number or null, but got 'abc'"),
    ("stable.max_cv=true", "stable.max_cv must be a number or null, but got true"),
    ("stable.alpha=often", "stable.alpha must be a number, but got 'often'"),
    ("noise.start_runs=two", "noise.start_runs must be an integer"),
    ("noise.control=fast", "noise.control must be a mapping"),
    ("measure.min_windows=abc", "measure.min_windows must be an integer"),
    ("measure.window_s=abc", "measure.window_s must be a number"),
    ("revalidate.processes=abc", "revalidate.processes must be an integer"),
    ("+slo.latency_p95_ms=abc", "slo.latency_p95_ms must be a number, but got 'abc'"),
    ("runs_dir=null", "runs_dir must be a string, but got null"),
    ("study=5", "study must be a mapping of its settings"),
    ("study.n_trials=${by_device:a,b}", "study.n_trials must be an integer, but got 'a'"),
]


OUT_OF_RANGE = [
    ("stable.alpha=0", "stable.alpha must lie in (0, 1), but got 0"),
    ("stable.excess_cv=-0.1", "stable.excess_cv must be a fraction >= 0"),
    ("noise.budget=1", "noise.budget must lie in [0, 1), but got 1"),
    ("noise.start_runs=1", "noise.start_runs must be an integer >= 2, but got 1"),
    ("noise.probe_windows=1", "noise.probe_windows must be an integer >= 2, but got 1"),
]


@pytest.mark.parametrize("override, expected", OUT_OF_RANGE, ids=[o for o, _ in OUT_OF_RANGE])
def test_out_of_range_is_refused(override, expected):
    assert expected in _one_line_error(override)


@pytest.mark.parametrize("override, expected", WRONG_TYPE, ids=[o for o, _ in WRONG_TYPE])
def test_wrong_type_is_refused(override, expected):
    assert expected in _one_line_error(override)


SECTIONS = {
    "study": StudySettings,
    "runner": RunnerSettings,
    "measure": MeasureSettings,
    "stable": StableSettings,
    "noise": NoiseSettings,
    "revalidate": RevalidateSettings,
    "tracking": TrackingSettings,
}


@pytest.mark.parametrize("section", SECTIONS)
def test_unknown_key_in_a_section_is_refused(section):
    message = _one_line_error(f"+{section}.bogus=1")
    assert f"unknown config key '{section}.bogus'" in message
    fields = ", ".join(f.name for f in dataclasses.fields(SECTIONS[section]))
    assert f"the keys under {section} are {fields}" in message


def test_unknown_top_level_key_is_refused_with_a_suggestion():
    message = _one_line_error("+devcie=cpu")
    assert "unknown config key 'devcie': the keys are runs_dir, device," in message
    assert "did you mean 'device'?" in message


def test_a_deleted_setting_is_named():
    assert "study.n_trials has no value" in _one_line_error("~study.n_trials")


@pytest.mark.parametrize(
    "override",
    [
        "runner.timeout_s=null",
        "runner.memory_limit_mb=4000",
        "study.timeout_s=60",
        "revalidate.processes=0",
        "seed=7",
        "+slo.latency_p95_ms=200",
        "stable.max_cv=1",
        "stable.max_cv=null",
        "noise.budget=0",
        "+noise.control.batch_size=16",
    ],
)
def test_good_values_compose(override):
    compose_config(["+space=llm", "device=cpu", override])


# ---------------------------------------------------------------------------------------------
# load_settings


@pytest.mark.parametrize("preset", ["cpu", "cuda"])
def test_load_settings_gives_typed_resolved_settings(preset):
    cfg = compose_config(["+space=llm", "device=cpu", f"preset={preset}", "runs_dir=/r"])
    settings = load_settings(cfg)
    assert isinstance(settings, Settings)
    assert isinstance(settings.study, StudySettings) and isinstance(settings.runner, RunnerSettings)
    assert isinstance(settings.measure, MeasureSettings)
    assert isinstance(settings.stable, StableSettings)
    assert isinstance(settings.revalidate, RevalidateSettings)
    assert isinstance(settings.tracking, TrackingSettings)
    assert type(settings.seed) is int and type(settings.study.n_trials) is int
    assert type(settings.runner.timeout_s) is float and type(settings.measure.max_time_s) is float
    assert type(settings.revalidate.max_candidates) is int
    assert settings.study.n_trials == (22 if preset == "cpu" else 24)  # ${by_device:22,24}
    assert settings.study.name == "llm-cpu"  # named by the device type, not the preset
    assert settings.study.storage == "sqlite:////r/optuna.db"
    assert settings.tracking.experiment == "llm"
    assert settings.slo == {}
    assert isinstance(settings.space, dict) and settings.space["name"] == "llm"
    assert "${" not in str(dataclasses.asdict(settings))


def test_load_settings_converts_slo_limits_to_numbers():
    cfg = compose_config(["+space=llm", "device=cpu", "+slo.latency_p95_ms=200"])
    settings = load_settings(cfg)
    assert settings.slo == {"latency_p95_ms": 200.0}
    assert type(settings.slo["latency_p95_ms"]) is float


def test_load_settings_accepts_a_config_the_schema_was_not_applied_to():
    plain = OmegaConf.create(resolve(compose_config(["+space=llm", "device=cpu"])))
    assert isinstance(load_settings(plain), Settings)
    plain.seed = -3
    with pytest.raises(ConfigError, match="seed must be an integer from 0 to 2147483647"):
        load_settings(plain)


def test_composed_config_stays_as_written_and_the_settings_are_typed():
    # MLflow params and --cfg show values as the config file and overrides write them.
    cfg = compose_config(["+space=llm", "device=cpu", "runner.timeout_s=120"])
    assert resolve(cfg)["runner"]["timeout_s"] == 120 and isinstance(
        resolve(cfg)["runner"]["timeout_s"], int
    )
    assert load_settings(cfg).runner.timeout_s == 120.0
    assert isinstance(load_settings(cfg).runner.timeout_s, float)


def test_schema_is_registered_in_the_config_store():
    compose_config(["+space=llm", "device=cpu"])
    assert OmegaConf.get_type(ConfigStore.instance().load(f"{SCHEMA_NAME}.yaml").node) is Settings


# ---------------------------------------------------------------------------------------------
# Every field says what it is


def _dataclasses_of(cls: type) -> list[type]:
    found = [cls]
    for kind in typing.get_type_hints(cls).values():
        if dataclasses.is_dataclass(kind):
            found += _dataclasses_of(kind)
    return found


@pytest.mark.parametrize("cls", _dataclasses_of(Settings), ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls):
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    documented = set()
    for statement, following in zip(node.body, node.body[1:] + [None], strict=True):
        if isinstance(statement, ast.AnnAssign):
            literal = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
            doc = following.value.value if literal else None
            assert isinstance(doc, str) and doc.strip(), f"{cls.__name__}.{statement.target.id}"
            documented.add(statement.target.id)
    assert documented == {f.name for f in dataclasses.fields(cls)}


def test_config_yaml_sets_exactly_the_schema_fields():
    """conf/config.yaml holds the defaults: one for every setting, and nothing else."""
    raw = yaml.safe_load((CONF_DIR / "config.yaml").read_text())
    assert set(raw) == {f.name for f in dataclasses.fields(Settings)} - {"space"}
    for section, cls in SECTIONS.items():
        assert list(raw[section]) == [f.name for f in dataclasses.fields(cls)], section
