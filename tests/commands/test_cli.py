"""Bad input: one line on stderr, exit code 2, no traceback, nothing written to runs_dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from search.commands.cli import main
from search.measurement.energy import CpuEnergyMonitor

REPO = Path(__file__).resolve().parents[2]

BAD_SPACES = str(REPO / "tests" / "bad_spaces")
BAD_INPUT = {
    "no space": ([], "add +space=NAME"),
    "unknown space": (
        ["+space=nope"],
        "built-in spaces are hf, llama, llm, llm_serve, timm, vision",
    ),
    "unknown key": (["+space=llm", "study.n_trails=3"], "unknown config key 'study.n_trails'"),
    "unknown option": (["+space=llm", "--frobnicate"], "unknown option"),
    "knob that does not apply to serving": (
        ["+space=llm_serve", "+space.params.recompute={type: bool}"],
        "knob recompute does not apply to workload search.workloads.GPTServe (task serve",
    ),
    "a compile mode the device cannot run, and nothing else": (
        ["+space=llm", "device=cpu", "space.params.compile.choices=[reduce-overhead]"],
        "params.compile=reduce-overhead cannot run on cpu: reduce-overhead replays CUDA graphs",
    ),
    "an attention kernel the device cannot run": (
        ["+space=llm", "device=cpu", "space.params.attention.choices=[efficient]"],
        "params.attention=efficient cannot run on cpu: the memory-efficient kernel is CUDA's only",
    ),
    "a compile mode that does not exist": (
        ["+space=llm", "space.params.compile.choices=[off,fast]"],
        "params.compile must be one of off, default, reduce-overhead, max-autotune",
    ),
    "serving objective on a training space": (
        ["+space=llm", "+space.objectives.ttft_p95_ms=minimize"],
        "objective ttft_p95_ms is measured only for serve workloads",
    ),
    "serving slo on a training space": (
        ["+space=vision", "+slo.tpot_p95_ms=20"],
        "slo.tpot_p95_ms is measured only for serve workloads",
    ),
    "a workload knob value the workload refuses": (
        ["+space=vision", "space.params.branches.choices=[serial,both]"],
        "TwoBranchCNN refuses branches='both': `branches` must be one of",
    ),
    "workload settings the workload refuses": (
        ["+space=llm", "space.workload.n_heads=3"],
        "GPT cannot be built from its settings: `d_model % n_heads == 0` must hold",
    ),
    "summary of a study that does not exist": (
        ["+space=llm", "study.n_trials=0"],
        "no study 'llm-cpu' in",
    ),
    "negative trials": (
        ["+space=llm", "study.n_trials=-1"],
        "study.n_trials must be an integer >= 0",
    ),
    "unknown device": (["+space=llm", "device=tpu"], "unknown device 'tpu'"),
    "unknown sampler": (["+space=llm", "study.sampler=magic"], "study.sampler must be one of"),
    "low > high": (["+space=llm", "space.params.batch_size.low=64"], "`low <= high` must hold"),
    "empty choices": (
        ["+space=llm", "space.params.precision.choices=[]"],
        "choices must be a non-empty list",
    ),
    "unknown objective": (
        ["+space=llm", "+space.objectives.speed=maximize"],
        "unknown metric 'speed'",
    ),
    "impossible constraint": (
        ["+space=llm", "space.constraints=['batch_size < 0']"],
        "no configuration satisfies",
    ),
    "constraint on unknown knob": (
        ["+space=llm", "space.constraints=['foo > 1']"],
        "unknown knob 'foo'",
    ),
    "target does not import": (
        ["+space=llm", "space.workload._target_=nowhere.Model"],
        "does not import",
    ),
    "bad measure setting": (["+space=llm", "measure.min_windows=1"], "min_windows"),
    "unquoted override": (["+space=llm", "space.constraints=[a < b]"], "quote values"),
    "unknown slo metric": (["+space=llm", "+slo.speed=3"], "slo.speed: unknown metric"),
    "unknown preset": (["+space=llm", "preset=gpu"], "preset must be one of auto, cpu, cuda"),
    "seed not an integer": (["+space=llm", "seed=abc"], "seed must be an integer"),
    "seed past numpy's": (
        ["+space=llm", "seed=4294967296"],
        "seed must be an integer from 0 to 2147483647, but got 4294967296",
    ),
    "a step past the range's end": (
        ["+space=llm", "space.params.batch_size.pow2=false", "+space.params.batch_size.step=8"],
        "high must be low plus a whole number of steps, but got low=4, high=32, step=8; the last "
        "step is 28: write high: 28",
    ),
    "knob the workload does not take": (
        ["+space=llm", "+space.params.dropuot=0.1"],
        "knob 'dropuot' is neither a generic knob",
    ),
    "unknown precision": (
        ["+space=llm", "space.params.precision.choices=[fp32,fp8]"],
        "params.precision must be one of fp32, tf32, bf16, fp16, fp8-tensorwise, fp8-rowwise, but "
        "got ['fp8']",
    ),
    "no batch_size": (
        [
            "+space=llm",
            "~space.params.batch_size",
            "space.constraints=[]",
            "space.memory_grows_with=[]",
        ],
        "must set batch_size",
    ),
    "memory_grows_with a categorical knob": (
        ["+space=llm", "space.memory_grows_with=[precision]"],
        "memory_grows_with names 'precision', which is not an int or float knob",
    ),
    "timeout shorter than a measurement": (
        ["+space=llm", "runner.timeout_s=5"],
        "runner.timeout_s (5 s) must exceed measure.max_time_s",
    ),
    "negative memory limit": (
        ["+space=llm", "runner.memory_limit_mb=-1"],
        "runner.memory_limit_mb must be a positive",
    ),
    "failure rate above 1": (
        ["+space=llm", "study.max_failure_rate=2"],
        "study.max_failure_rate must be a fraction",
    ),
    "key added with + that nothing reads": (
        ["+space=llm", "+study.n_trails=3"],
        "the keys under study are",
    ),
    "slo without a plus": (["+space=llm", "slo.latency_p95_ms=200"], "+slo.latency_p95_ms=VALUE"),
    "a mistyped command": (
        ["histroy", "+space=llm"],
        "'histroy' is not an override KEY=VALUE, nor a command where one goes first",
    ),
    "an empty argument": (["+space=llm", ""], "an empty argument is no override"),
    "an override with no key": (["+space=llm", "=5"], "'=5' has no key: write KEY=VALUE"),
    "a list of spaces (Hydra would merge them)": (
        ["+space=[llm,vision]"],
        "'+space=[llm,vision]': choose one space, +space=NAME",
    ),
    "a number for the space": (["+space=5"], "+space takes the name of a space"),
    "a --config-dir that does not exist (Hydra only warns)": (
        ["--config-dir", "{tmp}/nowhere", "+space=llm"],
        "/nowhere: no such directory",
    ),
    "noise.control not a mapping of knobs": (
        ["+space=llm", "noise.control=5"],
        "noise.control must be a mapping of knob name to value, e.g. noise.control={precision:",
    ),
    "noise.control a list (OmegaConf names no key)": (
        ["+space=llm", "noise.control=[1]"],
        "noise.control must be a mapping of knob name to value",
    ),
    "an unknown key inside a section given whole": (
        ["+space=llm", "study={n_trails:3}"],
        "unknown config key 'study.n_trails': the keys under study are",
    ),
    "a list for a searched knob": (
        ["+space=llm", "space.params.batch_size=[4,8]"],
        "space.params.batch_size is a range or a list of choices, which a list cannot replace",
    ),
    "an unknown key under noise.control without a plus": (
        ["+space=llm", "noise.control.batch_size=16"],
        "unknown config key 'noise.control.batch_size': check the spelling (python -m search "
        "--cfg +space=NAME prints every key), or add it with +noise.control.batch_size=",
    ),
    "every configuration breaks the step's rules": (
        [
            "+space=llm",
            "space.constraints=[]",
            "space.params.micro_batch_size=3",
            "space.memory_grows_with=[batch_size]",
        ],
        "no configuration can run, e.g. `micro_batch_size` must divide `batch_size`",
    ),
    "a recompute part GPT does not name": (
        ["+space=llm", "space.params.recompute=maybe"],
        "params.recompute choice 'maybe' is no part of search.workloads.GPT: it takes none, all, "
        "every-K and attention, mlp",
    ),
    "an slo no configuration can meet": (
        ["+space=llm", "+slo.latency_p95_ms=-1"],
        "slo.latency_p95_ms must be > 0 (ms), or no configuration can meet it",
    ),
    "an empty runs_dir (the stores would go to /)": (
        ["+space=llm", "runs_dir="],
        "runs_dir must be a directory",
    ),
    "an empty study name (its files would go to runs_dir itself)": (
        ["+space=llm", "study.name="],
        "study.name must be a non-empty name without / or",
    ),
    "a study name that leaves runs_dir": (
        ["+space=llm", "study.name=../elsewhere"],
        "study.name must be a non-empty name without / or",
    ),
    "an empty tracking URI (a store in the working directory)": (
        ["+space=llm", "tracking.uri="],
        "tracking.uri must be an MLflow tracking URI, not empty",
    ),
    "storage that cannot be opened": (
        ["+space=llm", "study.storage=notaurl"],
        "cannot open study.storage 'notaurl'",
    ),
    "control with an unknown knob": (
        ["+space=llm", "+noise.control.batch=8"],
        "noise.control names batch, which space 'llm' does not have",
    ),
    "control that breaks a constraint": (
        ["+space=llm", "+noise.control.micro_batch_size=8"],
        "batch_size % micro_batch_size == 0",
    ),
    "slo not a mapping": (["+space=llm", "slo=5"], "slo must be a mapping of metric name"),
    "negative seed": (["+space=llm", "seed=-1"], "seed must be an integer from 0 to 2147483647"),
    "nan timeout": (["+space=llm", "runner.timeout_s=nan"], "runner.timeout_s must be a finite"),
    "inf memory limit": (
        ["+space=llm", "runner.memory_limit_mb=inf"],
        "runner.memory_limit_mb must be a finite",
    ),
    "nan max_cv": (["+space=llm", "stable.max_cv=nan"], "stable.max_cv must be a finite"),
    "nan int bound": (["+space=llm", "space.params.batch_size.high=nan"], "params.batch_size"),
    "float bound on an int knob": (
        ["+space=llm", "space.params.batch_size.low=1.5"],
        "params.batch_size",
    ),
    "mixed-type choices": (
        ["+space=llm", "space.params.precision.choices=[fp32,1]"],
        "params.precision: choices must be all numbers, all strings or all true/false",
    ),
    "choices mixing numbers and strings": (
        ["+space=llm", "+space.params.heads={type:categorical,choices:[2,four]}"],
        "mixes numbers and strings",
    ),
    "choices mixing true/false and numbers": (
        ["+space=llm", "+space.params.flag={type:categorical,choices:[true,0]}"],
        "mixes numbers and true/false",
    ),
    "nan float bound": (
        ["+space=llm", "+space.params.dropout={type:float,low:0.0,high:nan}"],
        "params.dropout: high must be a finite number",
    ),
    "inf float bound": (
        ["+space=llm", "+space.params.dropout={type:float,low:-inf,high:0.2}"],
        "params.dropout: low must be a finite number",
    ),
    "alpha out of range": (["+space=llm", "stable.alpha=1.5"], "stable.alpha must lie in (0, 1)"),
    "control budget out of range": (
        ["+space=llm", "noise.budget=-0.1"],
        "noise.budget must lie in [0, 1)",
    ),
    "one control run at the start": (
        ["+space=llm", "noise.start_runs=1"],
        "noise.start_runs must be an integer >= 2",
    ),
    "huge int range on a knob the workload takes": (
        ["+space=llm", "space.params.micro_batch_size.low=0"],
        "params.micro_batch_size",
    ),
    "a tracking URI that names a folder": (
        ["+space=llm", "tracking.uri=mlruns"],
        "tracking.uri 'mlruns' names a folder, MLflow's file store, which MLflow 3 refuses",
    ),
    "tracking uri that cannot be opened": (
        ["+space=llm", "tracking.uri=foo://bar"],
        "cannot open tracking.uri",
    ),
    "a workload whose optional package is missing": (
        ["+space=llama", "space.workload._target_=faults.NeedsAMissingPackage"],
        "needs no_such_package_for_search, which is not installed; install it with: pip install",
    ),
    "a recompute part the workload does not name": (
        [
            "+space=vision",
            "space.params.recompute.type=categorical",
            "+space.params.recompute.choices=[none,attention]",
        ],
        "cannot recompute attention: implement recompute_parts(model)",
    ),
    "a recompute setting of another form": (
        ["+space=llama", "space.params.recompute.choices=[none,every-0]"],
        "params.recompute must be none, all, every-K, selective, budget-F (0 < F < 1), a part's "
        "name, or true or false",
    ),
    "a space set without its plus": (["space=llm"], "a space is added, not set: write +space=llm"),
    "a space named with its extension": (
        ["+space=llm.yaml"],
        "name the space without its extension, +space=llm",
    ),
    "a misspelled knob of the space": (
        ["+space=llm", "space.params.batchsize.high=8"],
        "unknown config key 'space.params.batchsize': did you mean 'space.params.batch_size'?",
    ),
    "a control of one's own with a typo, where no control runs are made": (
        ["+space=llm", "noise.budget=0", "noise.control={batchsize:4}"],
        "noise.control names batchsize, which space 'llm' does not have",
    ),
    "a batch with no tensor in it": (
        ["+space=llm", "space.workload._target_=contract_breaches.BatchOfNumbers"],
        "make_batch(1, generator) returned list with no tensor in it; return a tensor, or a",
    ),
    "a batch short of its samples": (
        ["+space=llm", "space.workload._target_=contract_breaches.BatchOneShort"],
        "make_batch(1, generator) returned a tensor of shape (0, 129); each tensor holds the 1 "
        "samples along its first dimension",
    ),
    "a batch that cannot be drawn": (
        ["+space=llm", "space.workload._target_=contract_breaches.BatchThatRaises"],
        "make_batch(1, generator) raised RuntimeError: the dataset is not there",
    ),
    "a knob of the workload's own that only build_model trips on": (
        [
            "+space=llm",
            "space.workload._target_=contract_breaches.ActivationByName",
            "+space.params.activation={type:categorical,choices:[GELU,Gelu]}",
        ],
        "build_model() at activation='Gelu' raised AttributeError: module 'torch.nn' has no "
        "attribute 'Gelu'; leave that value out of the space, or add a constraint",
    ),
    "a knob only build_model trips on, in a space too large to list (a float knob)": (
        [
            "+space=llm",
            "space.workload._target_=contract_breaches.ActivationByName",
            "+space.params.activation={type:categorical,choices:[GELU,Gelu]}",
            "+space.params.dropout={type:float,low:0.0,high:0.1}",
        ],
        "build_model() at activation='Gelu' (with dropout=0.0) raised AttributeError",
    ),
    "a model that cannot be built at any configuration": (
        ["+space=llm", "space.workload._target_=contract_breaches.WidthAsText"],
        "build_model() raised TypeError: empty(): argument 'size'",
    ),
    "a constructor that exits": (
        ["+space=llm", "space.workload._target_=contract_breaches.ExitsInItsConstructor"],
        "ExitsInItsConstructor cannot be built from its settings: it called sys.exit(5)",
    ),
    "a control value outside the space's range": (
        ["+space=llm", "+noise.control.batch_size=7"],
        "(batch_size=7: not among the values the space gives it)",
    ),
    "a constraint that alone holds for nothing": (
        ["+space=llm", "space.constraints=['batch_size / 0 > 1', 'streams <= 2']"],
        "alone, 'batch_size / 0 > 1' held for none tried",
    ),
    "~KEY then KEY=VALUE": (
        ["+space=llm", "~study.storage", "study.storage=sqlite:///x.db"],
        "config key 'study.storage' was removed (~study.storage) before an override set it",
    ),
    "an unclosed bracket": (
        ["+space=llm", "study.n_trials=[1,2"],
        "cannot parse an override at '[1,2' (a bracket or quote left open?)",
    ),
    "by_device with one value": (
        ["+space=llm", "space.params.batch_size.high=${by_device:8}"],
        "cannot resolve space.params.batch_size.high: ${by_device:...} takes two values",
    ),
    "a model that is no module": (
        ["+space=llm", "space.workload._target_=contract_breaches.ModelThatIsAFunction"],
        "build_model() returned function, not a torch.nn.Module",
    ),
    "a loss per token": (
        ["+space=llm", "space.workload._target_=contract_breaches.LossPerToken"],
        "loss(model, batch) must return one value (a mean over the batch), but returned (128,)",
    ),
    "a loss cut from the model": (
        ["+space=llm", "space.workload._target_=contract_breaches.DetachedLoss"],
        "loss(model, batch) does not depend on the model's parameters",
    ),
    "space file that is a list": (
        ["--config-dir", BAD_SPACES, "+space=a_list"],
        "space 'a_list' must be a mapping",
    ),
    "space file that is empty": (
        ["--config-dir", BAD_SPACES, "+space=empty"],
        "space 'empty' is empty",
    ),
    "space file that is not YAML": (["--config-dir", BAD_SPACES, "+space=broken"], "broken.yaml"),
    "unicode knob name": (
        ["--config-dir", BAD_SPACES, "+space=unicode_knob"],
        "knob name 'größe' must be an ASCII identifier",
    ),
    "nested _target_ in the workload settings": (
        ["+space=llm", "+space.workload.inner={_target_:os.getcwd}"],
        "workload.inner sets _target_",
    ),
    "constraint comparing a number with a string on a continuous space": (
        [
            "+space=llm",
            "+space.params.dropout={type:float,low:0.0,high:0.2}",
            "space.constraints=['dropout > \\'high\\'']",
        ],
        "cannot be evaluated",
    ),
    "impossible constraint on a continuous space": (
        [
            "+space=llm",
            "+space.params.dropout={type:float,low:0.0,high:0.2}",
            "space.constraints=['dropout > 0.5']",
        ],
        "none of 10000 random draws did",
    ),
    "runs_dir that is a file": (["+space=llm", "runs_dir={tmp}/a-file"], "cannot write runs_dir"),
    "runs_dir on a read-only file system": (
        ["+space=llm", "runs_dir=/sys/kernel"],
        "cannot write runs_dir '/sys/kernel'",
    ),
    "study name with both quote characters": (
        ["+space=llm", "study.name='it\\'s \"x\"'"],
        "study.name",
    ),
}


@pytest.mark.parametrize("argv, expected", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_exits_2_with_one_line(argv, expected, tmp_path, capsys):
    runs_dir = tmp_path / "runs"
    (tmp_path / "a-file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    before = sorted(tmp_path.rglob("*"))
    if not any(a.startswith("runs_dir=") for a in argv):
        argv.append(f"runs_dir={runs_dir}")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("search: error: "), err
    assert expected in err
    assert sorted(tmp_path.rglob("*")) == before, "nothing written"
    assert (tmp_path / "a-file").read_text() == ""


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("llm", "description: mine\n", "has the name of a built-in space: rename it"),
        ("binary", "\x00\xbc\xff", "binary.yaml is not UTF-8 text"),
        (
            "offs",
            "workload: {_target_: search.workloads.GPT}\nobjectives: {throughput: maximize}\n"
            "params:\n  batch_size: 4\n  compile: {type: categorical, choices: [off, default]}\n",
            "[False, 'default'] mixes strings and true/false; quote off, on, yes and no",
        ),
    ],
    ids=["shadows a built-in", "not text", "unquoted off"],
)
def test_bad_space_files_of_ones_own_exit_2(name, content, expected, tmp_path, capsys):
    spaces = tmp_path / "mine" / "space"
    spaces.mkdir(parents=True)
    (spaces / f"{name}.yaml").write_bytes(content.encode("latin-1"))
    before = sorted(tmp_path.rglob("*"))
    argv = ["--config-dir", str(tmp_path / "mine"), f"+space={name}", f"runs_dir={tmp_path}/r"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["device=tpu"], "unknown device 'tpu'"),
        (["space.params.recompute=maybe"], "params.recompute choice 'maybe' is no part of"),
        (["device=gpu", "preset=cpu"], "unknown device 'gpu'"),
    ],
    ids=[
        "unknown device",
        "a recompute part the workload does not name",
        "unknown device, the preset named",
    ],
)
def test_cfg_refuses_what_a_run_would_refuse(argv, expected, capsys):
    assert main(["+space=llm", *argv, "--cfg"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and expected in captured.err


def test_a_loss_the_meta_device_cannot_run_is_left_to_the_step(capsys):
    # Its loss reads a value (.item()), which a model on the meta device cannot give: the
    # contract check cannot see it break anything, so the space runs.
    argv = ["+space=llm", "space.workload._target_=contract_breaches.LossThatReadsAValue"]
    assert main([*argv, "--cfg"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    "target, choices",
    [
        ("ActivationByName", "[GELU,ReLU]"),  # every name one torch.nn has
        # builds on no device the check can use: its failure tells nothing of the knob's values
        ("NoModelOnTheMetaDevice", "[GELU,Gelu]"),
        # reads a tensor as a numpy array, which a meta tensor cannot be (a TypeError naming
        # the meta device): left to the trials, which build on a real device
        ("NumpyInItsBuild", "[GELU,ReLU]"),
    ],
)
def test_what_the_meta_device_alone_cannot_build_is_left_to_the_trials(target, choices, capsys):
    argv = [
        "+space=llm",
        f"space.workload._target_=contract_breaches.{target}",
        f"+space.params.activation={{type:categorical,choices:{choices}}}",
    ]
    assert main([*argv, "--cfg"]) == 0, capsys.readouterr().err


def test_fixing_a_knob_that_memory_grows_with_names_needs_no_second_override(capsys):
    assert main(["+space=llm", "space.params.batch_size=8", "--cfg"]) == 0
    assert "batch_size: 8" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the CUDA preset on a machine without")
def test_cfg_prints_another_devices_preset_to_read(capsys):
    # A run with preset=cuda on a CPU is refused (tf32 and the CUDA compile modes cannot run
    # here); printing it is how one reads the GPU's search space from a laptop.
    assert main(["+space=llm", "preset=cuda", "--cfg"]) == 0
    assert "reduce-overhead" in capsys.readouterr().out


def test_bad_input_from_the_shell_has_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "search",
            "+space=llm",
            "space.params.streams.type=integer",
            f"runs_dir={tmp_path / 'runs'}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
    assert "type must be one of int, float, categorical, bool" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_help_lists_the_main_command(capsys):
    assert main(["--help"]) == 0
    assert "python -m search +space=NAME" in capsys.readouterr().out


def test_resuming_with_other_objectives_exits_2_and_names_them(tmp_path, capsys):
    import optuna

    storage = f"sqlite:///{tmp_path}/optuna.db"
    optuna.create_study(
        study_name="llm-cpu", storage=storage, directions=["maximize", "minimize", "minimize"]
    )
    argv = [
        "+space=llm",
        "device=cpu",
        f"runs_dir={tmp_path}",
        f"study.storage={storage}",
        "~space.objectives.peak_memory_mb",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "choose a new study.name" in err
    assert not (tmp_path / "mlflow.db").exists()


def test_runs_dir_that_cannot_be_made_exits_2(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["+space=llm", f"runs_dir={blocker / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write runs_dir" in err


@pytest.mark.skipif(CpuEnergyMonitor().available, reason="this host's RAPL counters are readable")
def test_energy_objective_where_energy_is_not_measurable_exits_2(tmp_path, capsys):
    argv = [
        "+space=llm",
        "device=cpu",
        "+space.objectives.energy_per_item_j=minimize",
        f"runs_dir={tmp_path / 'r'}",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "energy_per_item_j cannot be measured here" in err
    assert not (tmp_path / "r").exists()
    # a limit on it too: no configuration could meet it
    argv = ["+space=llm", "device=cpu", "+slo.energy_per_item_j=1", f"runs_dir={tmp_path / 'r'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "slo.energy_per_item_j cannot be measured here (" in err
    assert "so no configuration could meet it; remove it from the slo" in err
    assert not (tmp_path / "r").exists()


def test_malformed_space_yaml_exits_2_naming_the_file_and_line(tmp_path, capsys):
    (tmp_path / "space").mkdir()
    (tmp_path / "space" / "broken.yaml").write_text(
        "workload:\n  _target_: search.workloads.GPT\nparams: [unclosed\n  batch_size: 4\n"
    )
    runs_dir = tmp_path / "runs"
    assert main(["--config-dir", str(tmp_path), "+space=broken", f"runs_dir={runs_dir}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "broken.yaml" in err and "line 3" in err, err
    assert err.startswith("search: error: space 'broken' (") and "not valid YAML" in err, err
    assert not runs_dir.exists()


def test_a_constraint_that_cannot_be_evaluated_names_its_space(tmp_path, capsys):
    (tmp_path / "space").mkdir()
    (tmp_path / "space" / "mixed.yaml").write_text(
        "workload: {_target_: search.workloads.GPT, vocab_size: 64, seq_len: 16, d_model: 32,"
        " n_layers: 1, n_heads: 2}\n"
        "params:\n  batch_size: {type: int, low: 1, high: 8}\n"
        "  precision: {type: categorical, choices: [fp32, bf16]}\n"
        "constraints: [precision > 1]\nobjectives: {throughput: maximize}\n"
    )
    runs_dir = tmp_path / "runs"
    args = ["--config-dir", str(tmp_path), "+space=mixed", "device=cpu", f"runs_dir={runs_dir}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("search: error: space 'mixed': constraint 'precision > 1' cannot be ")
    assert not runs_dir.exists()


def test_a_process_with_another_heartbeat_interval_than_the_study_exits_2(tmp_path, capsys):
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    import optuna

    study = optuna.create_study(
        study_name="llm-cpu",
        storage=f"sqlite:///{runs_dir}/optuna.db",
        directions=["maximize", "minimize", "minimize"],
    )
    study.set_user_attr("heartbeat_s", 30)
    capsys.readouterr()  # Optuna's own line about creating the study
    assert main(["+space=llm", "device=cpu", "study.heartbeat_s=10", f"runs_dir={runs_dir}"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "keeps heartbeats every 30 s" in err
        and "study.heartbeat_s=30" in err
    )
    assert not (runs_dir / "mlflow.db").exists()


def test_a_failed_open_removes_only_what_this_process_created(tmp_path, capsys, monkeypatch):
    """Several processes start on a fresh runs_dir; one whose store cannot be opened must not take
    the others' files with it."""
    import search.storage.stores

    runs_dir = tmp_path / "runs"
    real_open = search.storage.stores.open_study

    def open_then_fail(*args, **kwargs):
        (runs_dir / "other-process.db").write_text("another process's study")
        real_open(*args, **kwargs)

    monkeypatch.setattr(search.storage.stores, "open_study", open_then_fail)
    assert main(["+space=llm", "study.storage=notaurl", f"runs_dir={runs_dir}"]) == 2
    assert (runs_dir / "other-process.db").read_text() == "another process's study"
    assert sorted(p.name for p in runs_dir.iterdir()) == ["other-process.db"]


def test_a_study_name_with_a_quote_runs(tmp_path):
    from invoke import search
    from tiny_overrides import TINY

    argv = ["+space=llm", *TINY, "study.n_trials=1", 'study.name="it\'s"', "noise.budget=0"]
    assert "study: it's in" in search(*argv, runs_dir=tmp_path / "runs").stdout
