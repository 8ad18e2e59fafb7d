"""The ``compile`` knob: refused where the device cannot run it, compiled before the timed windows
with its cost kept, and held to the eager step's numerics.

The compiled workloads here are a few small layers, so a cold compile takes seconds; the compiler's
cache (its default place) makes a second run of the suite faster still.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import replace

import pytest
import torch
import torch._dynamo
from torch import nn
from trial_workloads import BreaksEverywhere, MiscompiledSmall, Small, request, target

from search.analysis.run_figures import MICRO_BATCH_PHASE
from search.core.errors import KnobError
from search.core.records import COMPLETE, INFEASIBLE, config_name
from search.execution import isolation
from search.execution.fidelity import check_fidelity
from search.execution.isolation import run_isolated
from search.execution.knobs import Knobs, unsupported_reason
from search.execution.recompute import apply_recompute
from search.execution.train_step import TrainStep
from search.execution.worker import run_trial

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Each test compiles from scratch in this process: dynamo's in-memory cache of compiled
    frames would otherwise serve one test's graphs to the next (every trial is a fresh process)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_modes_that_need_cuda_are_refused_on_a_cpu_and_unknown_modes_everywhere():
    reason = unsupported_reason("compile", "reduce-overhead", CPU)
    assert reason is not None and "CUDA" in reason
    for mode in ("off", "default", "max-autotune"):
        assert unsupported_reason("compile", mode, CPU) is None
    with pytest.raises(KnobError, match="compile"):
        Knobs(batch_size=4, compile="fast")
    result = run_trial(request(target(Small), compile="reduce-overhead"))
    assert result.state == INFEASIBLE and "CUDA" in result.failure


def test_a_label_leaves_compile_out_when_off_and_names_its_mode_otherwise():
    assert config_name({"batch_size": 8, "compile": "off"}) == "bs8"
    assert config_name({"batch_size": 8, "compile": "max-autotune"}) == "bs8·compile:max-autotune"


def test_a_compiled_trial_computes_the_same_and_keeps_its_compile_time_apart():
    # An eager trial first: its build does what a process does once (imports on first use), which
    # a trial's worker, forked from the fork server, finds done; a warm compile of Small is shorter.
    assert run_trial(request(target(Small))).compile == {}  # eager: nothing to report
    result = run_trial(request(target(Small), micro_batch_size=2, compile="default"))
    assert result.state == COMPLETE, result.failure
    c = result.compile
    # the first pass compiled (seconds) and ran once; the timed steps are milliseconds
    assert c["compile_time_s"] > 20 * result.measurement.latency_mean_ms / 1e3
    assert c["compile_graphs"] >= 1 and c["compile_graph_breaks"] == 0
    assert c["compile_recompiles"] == 0  # every micro-batch has one shape
    assert c["compile_cache_warm"] in (0.0, 1.0)
    # the first pass (compile_time_s and one step) is the compile phase of the time line, not
    # the build's
    step_s = result.measurement.latency_mean_ms / 1e3
    phases = result.phases_s
    assert phases["compile"] == pytest.approx(c["compile_time_s"] + step_s, rel=1e-6)
    assert phases["build"] < phases["compile"]
    # compared with eager fp32 within fp32's tolerance, and the errors kept
    assert result.fidelity["fidelity_loss_rel_error"] < 1e-5


@pytest.mark.parametrize("dynamic", [True, False])
def test_on_a_cpu_one_compile_serves_every_micro_batch(monkeypatch, dynamic):
    # A study's fresh processes each try one micro-batch; one compiled code for every size means a
    # new micro-batch finds it in the cache instead of compiling C++ anew. Here, in one process,
    # dynamo's own cache of compiled frames shows it: the second size needs no new graph.
    from search.execution import train_step

    if not dynamic:  # as a CUDA step runs: specialized to its micro-batch
        monkeypatch.setattr(train_step, "DYNAMIC_MICRO_BATCH", frozenset())
    with TrainStep(Small(), Knobs(batch_size=8, micro_batch_size=4, compile="default"), CPU) as s:
        assert s.compile_stats is not None and s.compile_stats.graphs == 1
    with TrainStep(Small(), Knobs(batch_size=8, micro_batch_size=2, compile="default"), CPU) as s:
        assert s.compile_stats is not None
        assert s.compile_stats.graphs == (0 if dynamic else 1)


def test_a_compiled_step_s_first_gradients_are_those_of_the_pass_that_compiled_it():
    # The fidelity check's own pass of a compiled configuration: the pass that compiled the step
    # ran the same micro-batches from the same weights, so it is read, not run again.
    knobs = Knobs(batch_size=8, micro_batch_size=4, compile="default")
    with TrainStep(Small(), knobs, CPU) as step:
        loss, grads = step.loss_and_grads()
        assert step.take_phases()[MICRO_BATCH_PHASE] == []  # no micro-batch ran for it
        again_loss, again_grads = step.loss_and_grads()
        assert len(step.take_phases()[MICRO_BATCH_PHASE]) == 2  # the second one ran its pass
        step()  # the weights move: a pass from them, not the first one's
        moved_loss, _ = step.loss_and_grads()
        assert len(step.take_phases()[MICRO_BATCH_PHASE]) == 4
    assert again_loss == pytest.approx(loss, rel=1e-6) and moved_loss != pytest.approx(loss)
    for name, grad in grads.items():
        torch.testing.assert_close(again_grads[name], grad)


def test_a_compiled_step_that_computes_something_else_is_rejected_by_fidelity():
    report = check_fidelity(MiscompiledSmall(), Knobs(batch_size=4, compile="default"), CPU)
    assert not report.ok and "compile=default" in report.reason and "loss" in report.reason
    result = run_trial(request(target(MiscompiledSmall), compile="default"))
    assert result.state == INFEASIBLE and result.failure.startswith("fidelity: ")
    assert run_trial(request(target(MiscompiledSmall))).state == COMPLETE  # eager computes right


def test_a_platform_that_cannot_compile_gives_an_infeasible_trial_with_its_reason(
    monkeypatch, tmp_path
):
    # No C++ compiler, as the fresh worker process sees its environment (the compiler's settings
    # read CXX when they are imported), and an empty cache, whose compiled kernels would need none.
    monkeypatch.setenv("CXX", "no-such-compiler")
    # A worker started from this environment: a fork server that an earlier test of this process
    # started has imported the compiler's settings already, without CXX.
    monkeypatch.setattr(isolation, "worker_context", lambda: multiprocessing.get_context("spawn"))
    asked = replace(request(target(Small), compile="default"), compile_cache_dir=str(tmp_path))
    result = run_isolated(asked)
    assert result.state == INFEASIBLE, result.failure
    assert result.failure.startswith("compile=default cannot compile this step: ")
    assert "C++ compiler" in result.failure and "\n" not in result.failure


def test_a_graph_break_storm_is_refused_with_the_count():
    with pytest.raises(KnobError, match=r"graph breaks in one step \(more than 8\)"):
        TrainStep(BreaksEverywhere(), Knobs(batch_size=4, compile="default"), CPU)


def test_a_missing_cpp_compiler_is_found_before_anything_is_traced():
    # Inductor itself fails only at its code generation, after the tracing and lowering it did for
    # nothing: the trial is refused before the step runs at all.
    import torch._inductor.config
    from torch._inductor import cpp_builder

    from search.execution.compiling import warm_up

    ran = []
    cpp_builder.cpp_compiler_search.cache_clear()
    try:
        with (
            torch._inductor.config.patch({"cpp.cxx": ("no-such-compiler",)}),
            pytest.raises(KnobError, match="compile=default cannot compile this step: .*C\\+\\+"),
        ):
            warm_up(lambda: ran.append(True), "default", torch.device("cpu"))
    finally:
        cpp_builder.cpp_compiler_search.cache_clear()  # the real compiler for the tests after
    assert not ran, "the step never ran"


class Blocks(Small):
    def build_model(self):
        return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3)))

    def recompute_modules(self, model):
        return list(model)

    def loss(self, model, batch):
        x, _ = batch
        return model(x).square().mean()


@pytest.mark.parametrize("setting", ["all", "selective"])
def test_a_recomputed_step_traces_as_one_graph(setting):
    """Recompute asks whether the step's work is being counted; the compiler must see through
    that question, or each recomputed block breaks the graph (a llama step broke 9 times). The
    selective policy traces too: in a compiled step it is what keeps the products."""
    workload = Blocks()
    model = workload.build_model()
    apply_recompute(workload, model, setting)
    batch = workload.make_batch(4, torch.Generator().manual_seed(0))
    explained = torch._dynamo.explain(workload.loss)(model, batch)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]


class SmallWithDropout(Small):
    """Dropout between the layers: the compiled step draws its masks from the compiler's own
    random stream, never the eager reference's."""

    def build_model(self):
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 1))


class MiscompiledWithDropout(SmallWithDropout):
    """Dropout, and a loss 1% off when compiled: a real numeric break beside random layers."""

    def loss(self, model, batch):
        scale = 1.01 if torch.compiler.is_compiling() else 1.0
        return super().loss(model, batch) * scale


def test_dropout_does_not_decide_the_check_but_a_wrong_op_beside_it_still_does():
    knobs = Knobs(batch_size=4, compile="default")
    report = check_fidelity(SmallWithDropout(), knobs, CPU)
    assert report.ok, report.reason
    assert report.random_layers_off == 1 and report.errors["fidelity_random_layers_off"] == 1.0
    assert report.loss_rel_error < 1e-5
    torch._dynamo.reset()
    broken = check_fidelity(MiscompiledWithDropout(), knobs, CPU)
    assert not broken.ok and "loss" in broken.reason
    assert broken.reason.startswith("with 1 random layers off in both passes, ")
    # and the measured step keeps its dropout: only the check's passes switch it off
    workload = SmallWithDropout()
    with TrainStep(workload, knobs, CPU) as step:
        assert step.model[2].p == 0.3


class TinyGPT2(Small):
    """GPT-2 from transformers, tiny, with its default dropout (0.1 on embeddings, attention and
    residuals)."""

    def build_model(self):
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
        return GPT2LMHeadModel(config)

    def make_batch(self, size, generator):
        return torch.randint(0, 64, (size, 16), generator=generator)

    def loss(self, model, batch):
        return model(input_ids=batch, labels=batch).loss


def test_gpt2_with_its_default_dropout_keeps_the_compiler():
    pytest.importorskip("transformers")
    report = check_fidelity(TinyGPT2(), Knobs(batch_size=2, compile="default"), CPU)
    assert report.ok, report.reason
    assert report.random_layers_off >= 3  # embeddings, attention, residuals


def _saved_bytes(knobs: Knobs) -> int:
    """The bytes a step's forward saves for backward (every tensor autograd packs), compiled
    afresh."""
    torch._dynamo.reset()
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel() * t.element_size())
        return t

    with TrainStep(Blocks(), knobs, CPU) as step:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
    return sum(sizes)


def test_a_memory_budget_makes_the_compiled_step_save_less_and_compute_the_same():
    """``recompute=budget-F``: the compiler's partitioner keeps at most F of what it would keep
    and recomputes the rest; the step computes the same, the budget is the compiler's again once
    the step is closed, and an eager step, which has no partitioner, refuses it."""
    import torch._functorch.config as functorch_config

    before = functorch_config.activation_memory_budget
    compiled = Knobs(batch_size=64, compile="default")
    kept = _saved_bytes(compiled)
    budgeted = _saved_bytes(replace(compiled, recompute="budget-0.1"))
    assert budgeted < kept
    assert functorch_config.activation_memory_budget == before
    report = check_fidelity(Blocks(), replace(compiled, recompute="budget-0.1"), CPU)
    assert report.ok, report.reason
    with pytest.raises(KnobError, match="compile=off runs eagerly"):
        TrainStep(Blocks(), Knobs(batch_size=4, recompute="budget-0.5"), CPU)
    assert Knobs(batch_size=4, recompute="budget-.25").recompute == "budget-.25"
    for wrong in ("budget-0", "budget-1", "budget-1.5", "budget-"):
        with pytest.raises(KnobError, match="budget-F"):
            Knobs(batch_size=4, recompute=wrong)
