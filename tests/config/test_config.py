import random
import re
from pathlib import Path

import pytest
import torch
import yaml
from hydra.utils import get_class
from omegaconf import OmegaConf

from search.config.compose import compose_config, resolve, resolve_device
from search.core.errors import ConfigError
from search.execution.recompute import recompute_setting
from search.space.parse import parse_space
from search.strategy.order import next_move
from search.workloads import ServingWorkload, Workload

REPO = Path(__file__).resolve().parents[2]
SPACE_FILES = sorted((REPO / "spaces").glob("*.yaml"))
SPACE_NAMES = [p.stem for p in SPACE_FILES]
USER_DIR = REPO / "examples" / "user_workload"
BY_DEVICE = re.compile(r"^\$\{by_device:([^,\[\]{}]+),([^,\[\]{}]+)\}$")


def test_there_is_at_least_one_builtin_space():
    assert SPACE_NAMES


def _walk(node, path=()):
    """Every leaf of a nested mapping/list, with its key path."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, (*path, str(key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, (*path, str(i)))
    else:
        yield path, node


def _get(node, path):
    for key in path:
        node = node[int(key)] if isinstance(node, list) else node[key]
    return node


# ---------------------------------------------------------------------------------------------
# Every built-in space, under both presets


@pytest.fixture(
    scope="module",
    params=[(n, p) for n in SPACE_NAMES for p in ("cpu", "cuda")],
    ids=[f"{n}-{p}" for n in SPACE_NAMES for p in ("cpu", "cuda")],
)
def composed(request):
    name, preset = request.param
    cfg = compose_config([f"+space={name}", f"preset={preset}"])
    return name, preset, cfg, resolve(cfg)


def test_builtin_space_composes_and_parses(composed):
    name, _, cfg, resolved = composed
    assert cfg.space.name == name
    space = parse_space(cfg.space.name, resolved["space"])
    assert space.name == name
    assert space.params and space.objectives


def test_builtin_space_opens_with_the_experts_first_guess(composed):
    """The guided order opens at each knob's first value: the spaces list the expert's first.
    A serving engineer keeps the KV cache: without it, the CUDA preset's first trial re-ran the
    whole prefix for 128 requests per generated token and had measured nothing 125 s in."""
    name, _, _, resolved = composed
    space = parse_space(name, resolved["space"])
    move = next_move(space, [])
    assert move is not None and "expert's first guess" in move.why
    config = move.config
    assert config["precision"] == "bf16" and config["streams"] == 1
    assert config["batch_size"] == max(space.params["batch_size"].values())
    assert recompute_setting(config.get("recompute", False)) == "none"  # false, or none
    if "kv_cache" in space.params:
        assert config["kv_cache"] is True


def test_builtin_space_has_a_feasible_configuration(composed):
    name, _, cfg, resolved = composed
    space = parse_space(name, resolved["space"])
    feasible = space.feasible_configs()
    if feasible is None:  # continuous or too large to enumerate
        config = space.random_feasible(random.Random(0))
        assert config is not None
        assert space.violations(config) == []
    else:
        assert feasible
        assert all(space.violations(c) == [] for c in feasible)


def test_builtin_space_workload_imports(composed):
    name, _, _, resolved = composed
    cls = get_class(resolved["space"]["workload"]["_target_"])
    assert isinstance(cls, type) and issubclass(cls, (Workload, ServingWorkload))


def test_builtin_space_resolves_completely(composed):
    _, _, _, resolved = composed
    for path, value in _walk(resolved):
        assert not (isinstance(value, str) and "${" in value), path


def test_builtin_space_by_device_values_follow_the_preset(composed):
    """Every ``${by_device:A,B}`` in the space file gives A under preset=cpu and B under
    preset=cuda."""
    name, preset, _, resolved = composed
    raw = yaml.safe_load((REPO / "spaces" / f"{name}.yaml").read_text())
    checked = 0
    for path, text in _walk(raw):
        match = isinstance(text, str) and BY_DEVICE.match(text)
        if match:
            cpu, cuda = (yaml.safe_load(g) for g in match.groups())
            assert _get(resolved["space"], path) == (cpu if preset == "cpu" else cuda), path
            checked += 1
    if "${by_device:" not in (REPO / "spaces" / f"{name}.yaml").read_text():
        pytest.skip(f"{name}.yaml has no ${{by_device:...}} values")
    assert checked


# ---------------------------------------------------------------------------------------------
# conf/config.yaml


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def base_config(request):
    cfg = compose_config(["+space=llm", f"preset={request.param}", "device=cpu"])
    return request.param, cfg, resolve(cfg)


def test_config_yaml_resolves_every_key(base_config):
    _, cfg, resolved = base_config
    raw = yaml.safe_load((REPO / "conf" / "config.yaml").read_text())
    for path, _ in _walk(raw):
        value = _get(resolved, path)  # every key of config.yaml is present
        assert not (isinstance(value, str) and "${" in value), path
    for path, value in _walk(resolved):
        assert not (isinstance(value, str) and "${" in value), path
        assert value != "???", path
    assert OmegaConf.missing_keys(cfg) == set()


def test_config_yaml_by_device_values_follow_the_preset(base_config):
    preset, _, resolved = base_config
    raw = yaml.safe_load((REPO / "conf" / "config.yaml").read_text())
    checked = 0
    for path, text in _walk(raw):
        match = isinstance(text, str) and BY_DEVICE.match(text)
        if match:
            cpu, cuda = (yaml.safe_load(g) for g in match.groups())
            assert cpu != cuda, path  # otherwise this check could not tell the presets apart
            assert _get(resolved, path) == (cpu if preset == "cpu" else cuda), path
            checked += 1
    assert checked


def test_by_device_d_model(base_config):
    preset, _, resolved = base_config
    raw = yaml.safe_load((REPO / "spaces" / "llm.yaml").read_text())["workload"]["d_model"]
    cpu, cuda = (int(v) for v in BY_DEVICE.match(raw).groups())
    assert cpu != cuda
    assert resolved["space"]["workload"]["d_model"] == (cpu if preset == "cpu" else cuda)


def test_default_study_name_on_cpu():
    resolved = resolve(compose_config(["+space=llm", "preset=cpu", "device=cpu"]))
    assert resolved["study"]["name"] == "llm-cpu"
    assert resolved["tracking"]["experiment"] == "llm"


def test_study_name_follows_device_when_preset_is_auto():
    resolved = resolve(compose_config(["+space=llm", "preset=auto", "device=cuda:1"]))
    assert resolved["study"]["name"] == "llm-cuda"
    resolved = resolve(compose_config(["+space=llm", "preset=auto", "device=cpu"]))
    assert resolved["study"]["name"] == "llm-cpu"


def test_storage_and_tracking_follow_runs_dir():
    resolved = resolve(compose_config(["+space=llm", "preset=cpu", "runs_dir=/x"]))
    assert resolved["runs_dir"] == "/x"
    assert resolved["study"]["storage"] == "sqlite:////x/optuna.db"
    assert resolved["tracking"]["uri"] == "sqlite:////x/mlflow.db"


def test_overrides_reach_the_config():
    resolved = resolve(
        compose_config(["+space=llm", "preset=cpu", "study.n_trials=3", "+slo.latency_p95_ms=200"])
    )
    assert resolved["study"]["n_trials"] == 3
    assert resolved["slo"] == {"latency_p95_ms": 200}


# ---------------------------------------------------------------------------------------------
# A user's own space through --config-dir


def test_user_space_composes_and_its_workload_imports(monkeypatch):
    cfg = compose_config(["+space=mlp", "preset=cpu"], config_dirs=[str(USER_DIR)])
    resolved = resolve(cfg)
    space = parse_space(cfg.space.name, resolved["space"])
    assert space.name == "mlp"
    assert space.workload["_target_"] == "my_mlp.MLPRegression"
    assert space.feasible_configs()

    monkeypatch.syspath_prepend(str(USER_DIR))
    cls = get_class(space.workload["_target_"])
    assert issubclass(cls, Workload)
    assert Path(__import__(cls.__module__).__file__).resolve().parent == USER_DIR


@pytest.mark.parametrize("name", ["my,spaces", "it's [here]"])
def test_a_config_dir_with_a_comma_quote_or_bracket_in_its_path(tmp_path, name):
    import shutil

    where = tmp_path / name
    shutil.copytree(USER_DIR, where)
    cfg = compose_config(["+space=mlp", "preset=cpu"], config_dirs=[str(where)])
    assert cfg.space.name == "mlp"


def test_user_space_is_not_found_without_its_config_dir():
    with pytest.raises(ConfigError, match="unknown space 'mlp'"):
        compose_config(["+space=mlp"])


# ---------------------------------------------------------------------------------------------
# Errors: one line that says what to fix


def _one_line_error(overrides, config_dirs=()):
    with pytest.raises(ConfigError) as info:
        compose_config(overrides, config_dirs)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message and message.strip() == message
    return message


def test_no_space_chosen():
    message = _one_line_error(["preset=cpu"])
    assert "+space=NAME" in message
    for name in SPACE_NAMES:
        assert name in message


def test_unknown_space():
    message = _one_line_error(["+space=nosuchspace"])
    assert "unknown space 'nosuchspace'" in message
    for name in SPACE_NAMES:
        assert name in message
    assert "--config-dir" in message and "space/NAME.yaml" in message


@pytest.mark.parametrize("key, meant", [("study.n_trails", "study.n_trials"), ("devcie", "device")])
def test_unknown_override_key(key, meant):
    message = _one_line_error(["+space=llm", f"{key}=3"])
    assert f"unknown config key '{key}'" in message
    # The schema knows every key outside the space, so adding it with '+' would only be refused
    # next: the message names the key that was meant instead.
    assert f"did you mean '{meant}'?" in message and f"+{key}=" not in message


def test_unknown_key_in_the_space_says_how_to_add_it():
    message = _one_line_error(["+space=llm", "space.parms.x=3"])
    assert "unknown config key 'space.parms'" in message and "+space.parms=" in message


@pytest.mark.parametrize(
    "text",
    [
        "workload:\n  _target_: x.Y\nparams: {a: [1, 2\n",
        "workload:\n  _target_: x.Y\n   params: 3\n",
        "params:\n  a: 1\n  a: 2\n",
    ],
    ids=["unclosed_flow", "bad_indent", "duplicate_key"],
)
def test_malformed_yaml_space_file(tmp_path, text):
    (tmp_path / "space").mkdir()
    (tmp_path / "space" / "broken.yaml").write_text(text)
    message = _one_line_error(["+space=broken"], config_dirs=[str(tmp_path)])
    assert "broken.yaml" in message
    assert "line " in message
    assert 'File "' not in message


# ---------------------------------------------------------------------------------------------
# resolve_device


def test_resolve_device_cpu():
    assert resolve_device("cpu") == torch.device("cpu")


def test_resolve_device_auto():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.parametrize("spec", ["tpu", "gpu0", ""])
def test_resolve_device_unknown(spec):
    with pytest.raises(ConfigError, match="use auto, cpu, cuda or cuda:N"):
        resolve_device(spec)


def test_resolve_device_unsupported_type():
    with pytest.raises(ConfigError, match="unsupported device 'meta'"):
        resolve_device("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0"])
def test_resolve_device_cuda_without_cuda(spec):
    with pytest.raises(
        ConfigError, match=f"device={spec} but no CUDA device is visible here: use device=cpu"
    ):
        resolve_device(spec)


# ---------------------------------------------------------------------------------------------
# Choices the device cannot run


def _load(overrides):
    from search.config.compose import load_settings
    from search.config.prepare import load_space

    chosen = load_settings(compose_config(overrides))
    return load_space(chosen.space, resolve_device(chosen.device))


@pytest.mark.parametrize(
    ("override", "refused", "kept"),
    [
        ("space.params.precision.choices=[fp32,tf32,bf16]", "tf32", "[fp32,bf16]"),
        ("space.params.precision.choices=[bf16,fp8-rowwise]", "fp8-rowwise", "[bf16]"),
        ("space.params.compile.choices=[off,reduce-overhead]", "reduce-overhead", "[off]"),
        ("space.params.attention.choices=[default,math,cudnn]", "cudnn", "[default,math]"),
    ],
)
def test_a_searched_choice_a_cpu_cannot_run_is_refused_naming_the_override_that_leaves_it_out(
    override, refused, kept
):
    with pytest.raises(ConfigError) as caught:
        _load(["+space=llm", "device=cpu", override])
    message = str(caught.value)
    assert "\n" not in message and f"choice {refused} cannot run on cpu" in message
    name = override.split(".")[2]
    assert f"space.params.{name}.choices={kept}" in message


def test_the_cpu_presets_search_compile_and_load_without_a_note():
    for name in ("llm", "llama", "vision"):
        space, notes = _load([f"+space={name}", "device=cpu"])
        assert list(space.params["compile"].values()) == ["off", "default"] and not notes


# ---------------------------------------------------------------------------------------------
# What the workload checks read of a space too large to list


def _unlisted(params, constraints):
    """A space with a float knob, which cannot be listed."""
    knobs = {"batch_size": 4, **params, "lr": {"type": "float", "low": 0.0, "high": 1.0}}
    raw = {
        "workload": {"_target_": "x.Y"},
        "params": knobs,
        "constraints": constraints,
        "objectives": {"throughput": "maximize"},
    }
    return parse_space("t", raw)


def test_a_constraint_only_a_sampled_configuration_cannot_evaluate_is_refused_in_one_line():
    from search.config.prepare import _configs_to_check

    params = {
        "x": {"type": "int", "low": 0, "high": 1000},
        "mode": {"type": "categorical", "choices": ["a", "b"]},
    }
    space = _unlisted(params, ["x != 192 or mode < 1"])
    space.probe_constraints(random.Random(0))  # its fewer draws never reach x=192
    with pytest.raises(ConfigError) as caught:
        _configs_to_check(space)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("space 't': constraint 'x != 192")


def test_a_space_whose_feasible_configurations_are_rare_is_still_checked_on_one():
    from search.config.prepare import _configs_to_check

    space = _unlisted({"x": {"type": "int", "low": 0, "high": 3000}}, ["x == 1501"])
    assert space.feasible_sample(random.Random(0)) == []  # none among corners and draws
    (config,) = _configs_to_check(space)
    assert config["x"] == 1501
