"""The training step: one optimizer step of a workload, executed as its knobs say.

``TrainStep`` builds everything once (model, optimizer, micro-batches, lanes) and then runs one
optimizer step per call, so that calling it measures only the step. The knobs themselves, what they
may be and what a device refuses, are ``search.execution.knobs``'s.
"""

from __future__ import annotations

import contextlib
import functools
import reprlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from search.analysis.run_figures import MICRO_BATCH_PHASE
from search.core.errors import WorkloadContractError
from search.execution.attention import attention_kernel
from search.execution.compiling import (
    DYNAMIC_MICRO_BATCH,
    CompileStats,
    compiled,
    marked_dynamic,
    warm_up,
)
from search.execution.fp8 import convert_fp8
from search.execution.held import module_tensors, tensors_in
from search.execution.kernels import apply_kernels
from search.execution.knobs import (
    AUTOCAST_DTYPES,
    MATMUL_PRECISIONS,
    Knobs,
    build_model,
    concurrently,
    lane_threads,
    make_streams,
    map_tensors,
    refuse_unsupported,
    tensor_shapes,
)
from search.execution.marks import Mark, elapsed_ms, mark
from search.execution.optimizers import with_implementation
from search.execution.recompute import apply_recompute, memory_budget
from search.measurement.tensor_peak import MICRO_BATCH_RANGE
from search.workloads.base import Batch, Workload, is_counting

__all__ = ["TrainStep"]


class TrainStep:
    """One optimizer step of ``workload`` on ``device``, executed as ``knobs`` say.

    Model, optimizer, micro-batches and lanes are built once here. ``close()`` (or leaving a
    ``with`` block) restores the float32 matmul precision and stops the lane threads.
    """

    def __init__(self, workload: Workload, knobs: Knobs, device: torch.device, seed: int = 0):
        refuse_unsupported(knobs, device)
        self.workload, self.knobs, self.device = workload, knobs, device
        self.items_per_step: int = knobs.batch_size * workload.items_per_sample()
        self.model: nn.Module = build_model(workload, device, seed)
        # Kernels first (they may replace whole modules), fp8 on the linear layers then in place,
        # recompute last: it wraps the modules as they will run.
        apply_kernels(workload, self.model, knobs.kernels)
        self.fp8_layers = convert_fp8(self.model, knobs.precision)
        """Linear layers running in fp8 (0 unless the precision is an fp8 one)."""
        apply_recompute(workload, self.model, knobs.recompute)
        self._optimizer = with_implementation(
            workload.make_optimizer(self.model.parameters()), knobs.optimizer
        )
        micro_batches = _make_micro_batches(workload, knobs, device, seed)
        if knobs.compile != "off" and device.type in DYNAMIC_MICRO_BATCH:
            # Marked once here, out of the timed steps: on these devices ``.to(device)`` in a lane
            # returns the very tensor, marks and all.
            micro_batches = [map_tensors(marked_dynamic, batch) for batch in micro_batches]
        self._lane_batches = [micro_batches[lane :: knobs.streams] for lane in range(knobs.streams)]
        self._autocast_dtype = AUTOCAST_DTYPES.get(knobs.precision)  # None: autocast off
        self._grad_scaler = _make_grad_scaler(knobs.precision, device)
        self._streams = make_streams(knobs.streams, device)
        self._cuda_streams = [s for s in self._streams if s is not None]
        self._previous_matmul_precision = torch.get_float32_matmul_precision()
        self._lanes = lane_threads(knobs.streams)
        self._eager_loss = workload.loss
        self._previous_budget = _set_memory_budget(memory_budget(knobs.recompute))
        self._loss = compiled(self._eager_loss, knobs.compile)
        self._marks: list[tuple[Mark, Mark]] = []
        """Each micro-batch's start and end since the last ``take_phases``."""
        self.lanes_in_turn = False
        """Run the lanes one after another in the calling thread, each micro-batch in a profiler
        range (``MICRO_BATCH_RANGE``): how a CPU step's memory is read with several lanes
        (``search.measurement.tensor_peak``), never how it is timed."""
        self.compile_stats: CompileStats | None = None
        """What compiling took (``compile`` on); None when the step runs eagerly."""
        self._unstepped_losses: list[torch.Tensor] | None = None
        """The losses of the pass that compiled the step, while its gradients are still the
        parameters' and the weights as built: ``loss_and_grads`` reads them instead of running
        the same pass again (one pass of every compiled trial's fidelity check)."""
        if knobs.compile != "off":
            # One accumulation pass compiles forward and backward; no optimizer step is taken, so
            # weights stay as built, and the next pass's zero_grad drops its gradients.
            passes: list[list[torch.Tensor]] = []
            try:
                self.compile_stats = warm_up(
                    lambda: passes.append(self._accumulate()), knobs.compile, device
                )
            except BaseException:
                self.close()  # no `with` block will: the constructor did not return
                raise
            self._unstepped_losses = passes[0]
            self._marks.clear()

    def __call__(self) -> None:
        """One full optimizer step. On CUDA it does not synchronize, so the caller can time it.

        Exception: with fp16, ``GradScaler.step`` reads its inf/NaN check back to the host.
        """
        self._accumulate()
        self._update()

    def counted_parts(self) -> list[tuple[int, Callable[[], object]]]:
        """One step as the parts its work is counted from, in the order to run them, each with
        how many times a step runs it (``search.analysis.diagnosis.count_work``): the first
        micro-batch, whose gradients are new; a later one, which adds its gradients to them, for
        each of the others; the optimizer step. The batch splits evenly into micro-batches, so
        where they are of one shape every later one does the same work: two are counted instead
        of all (32 at micro-batch 1 of the ``llm`` CPU preset). A workload whose micro-batches
        differ in shape (a sequence length drawn per batch, say) has each counted."""
        batches = [batch for lane in self._lane_batches for batch in lane]

        def micro_batch(index: int) -> object:
            with attention_kernel(self.knobs.attention, self.knobs.compile != "off"):
                return self._micro_batch(batches[index])

        def first() -> object:
            self._begin_pass()
            return micro_batch(0)

        shapes = {tensor_shapes(batch) for batch in batches[1:]}
        if len(shapes) == 1:
            later = [(len(batches) - 1, functools.partial(micro_batch, 1))]
        else:  # none (one micro-batch), or of several shapes
            later = [(1, functools.partial(micro_batch, i)) for i in range(1, len(batches))]
        return [(1, first), *later, (1, self._update)]

    def loss_and_grads(self) -> tuple[float, dict[str, torch.Tensor]]:
        """The batch's mean loss and every parameter's gradient (fp32, CPU), without an optimizer
        step. Right after a compiled step's construction, those of the pass that compiled it: the
        same micro-batches from the same weights, so running it again would compute the same."""
        losses, self._unstepped_losses = self._unstepped_losses or self._accumulate(), None
        scale = 1.0 if self._grad_scaler is None else self._grad_scaler.get_scale()
        grads = {
            name: p.grad.to("cpu", torch.float32, copy=True).div_(scale)
            for name, p in self.model.named_parameters()
            if p.grad is not None
        }
        return float(torch.stack(losses).sum()), grads

    def drop_gradients(self) -> None:
        """Set every gradient to None, as the next step does first: then the step holds nothing
        from the last one, and its memory can be read from one profiled call
        (``search.measurement.tensor_peak``)."""
        self._unstepped_losses = None
        self._optimizer.zero_grad(set_to_none=True)

    def held_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor the step keeps between steps: the model's, its gradients, the optimizer's
        state and the micro-batches (``search.execution.held``)."""
        yield from module_tensors(self.model)
        yield from tensors_in(list(self._optimizer.state.values()))
        yield from tensors_in(self._lane_batches)

    def take_phases(self) -> dict[str, list[float]]:
        """Each micro-batch's time (forward and backward), ms, for the steps since the last take
        (``MICRO_BATCH_PHASE``). Call it with the device synchronised.

        A stall in one micro-batch of many hides inside the step's time (2% of micro-batches
        stalling 10x, 32 to a step, lengthen no step past twice the median), so the stall test
        also counts micro-batches (``search.stability.judge``)."""
        times = [elapsed_ms(start, end) for start, end in self._marks]
        self._marks.clear()
        return {MICRO_BATCH_PHASE: times}

    def close(self) -> None:
        """Restore the float32 matmul precision and the compiler's activation memory budget
        found at construction; stop the lane threads."""
        torch.set_float32_matmul_precision(self._previous_matmul_precision)
        _set_memory_budget(self._previous_budget)
        for lane in self._lanes:
            lane.shutdown()

    def __enter__(self) -> TrainStep:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _begin_pass(self) -> None:
        """Set the precision of float32 matrix products and drop the gradients: each pass
        starts so."""
        torch.set_float32_matmul_precision(MATMUL_PRECISIONS[self.knobs.precision])
        self.drop_gradients()

    def _update(self) -> None:
        """The optimizer step on the gradients the pass left (fp16: through the GradScaler)."""
        self._unstepped_losses = None  # the weights move
        if self._grad_scaler is None:
            self._optimizer.step()
        else:
            self._grad_scaler.step(self._optimizer)
            self._grad_scaler.update()

    def _accumulate(self) -> list[torch.Tensor]:
        """Zero the grads, run every micro-batch over the lanes; return each micro-batch's loss
        share."""
        self._begin_pass()
        streams = self._cuda_streams
        if streams:
            main = torch.cuda.current_stream(self.device)
            for stream in streams:
                stream.wait_stream(main)  # the last optimizer step must end before new grads land
        # The kernel setting is the process's: set here, in the calling thread, around every lane
        # (forward and backward, whose recomputed forwards must pick what their first pass did).
        # Set in each lane, the first lane to finish would restore it under the others.
        compiled = self.knobs.compile != "off"
        with attention_kernel(self.knobs.attention, compiled):
            calls = [functools.partial(self._run_lane, lane) for lane in range(self.knobs.streams)]
            if self.lanes_in_turn:
                lanes = [call() for call in calls]
            else:
                lanes = concurrently(self._lanes, calls)
        losses = [loss for lane in lanes for loss in lane]
        if streams:
            for stream in streams:
                main.wait_stream(stream)
        return losses

    def _run_lane(self, lane: int) -> list[torch.Tensor]:
        """Forward and backward of this lane's micro-batches, on its own thread (and CUDA
        stream)."""
        stream = self._streams[lane]
        losses = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for batch in self._lane_batches[lane]:
                with (
                    record_function(MICRO_BATCH_RANGE)
                    if self.lanes_in_turn
                    else contextlib.nullcontext()
                ):
                    losses.append(self._micro_batch(batch))
        return losses

    def _micro_batch(self, batch: Batch) -> torch.Tensor:
        """Forward and backward of one micro-batch; its loss share."""
        start = mark(self.device)
        batch = map_tensors(lambda t: t.to(self.device, non_blocking=True), batch)
        # Autocast is thread-local, so each lane enters it itself; backward runs outside it.
        # Its cache of weights cast to low precision is not: one map for the whole process.
        # A lane would take a cast another lane's stream has queued but not yet run, and
        # read garbage (on an H100, bf16 with 2 lanes gave a NaN loss in 1 of 9 fidelity
        # passes); with several lanes each casts its own weights.
        with torch.autocast(
            self.device.type,
            dtype=self._autocast_dtype,
            enabled=self._autocast_dtype is not None,
            cache_enabled=self.knobs.streams == 1,
        ):
            # Work is counted on the eager function: the counters see every operator.
            loss_fn = self._eager_loss if is_counting() else self._loss
            loss = _a_tensor(loss_fn(self.model, batch)) / self.knobs.n_micro_batches
        scaled = loss if self._grad_scaler is None else self._grad_scaler.scale(loss)
        scaled.backward()
        self._marks.append((start, mark(self.device)))  # list.append: thread-safe
        return loss.detach()


def _a_tensor(loss: Any) -> torch.Tensor:
    """``loss`` as the workload's ``loss`` returned it, which must be a tensor: a Python number
    (``float()`` or ``.item()`` of one) has no graph to take gradients through."""
    if not isinstance(loss, torch.Tensor):
        raise WorkloadContractError(
            f"loss(model, batch) must return a tensor (one value, a mean over the batch), but "
            f"returned {type(loss).__name__} {reprlib.repr(loss)}; return the tensor itself, not "
            "float() or .item() of it"
        )
    return loss


def _make_micro_batches(
    workload: Workload, knobs: Knobs, device: torch.device, seed: int
) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    batches = [
        workload.make_batch(knobs.micro_samples, generator) for _ in range(knobs.n_micro_batches)
    ]
    if device.type == "cuda":
        # Pinned host memory lets each lane's host-to-device copy run asynchronously on its stream.
        batches = [map_tensors(torch.Tensor.pin_memory, batch) for batch in batches]
    return batches


def _make_grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    if precision != "fp16":
        return None
    scaler = torch.amp.GradScaler(device.type)
    # The scale tensor is created lazily on first use; create it now, before lanes race to do so.
    scaler.scale(torch.ones((), device=device))
    return scaler


def _set_memory_budget(budget: float | None) -> float | None:
    """Set the compiler's activation memory budget (``recompute=budget-F``; None leaves it as it
    is) for the steps compiled from now on; the budget it replaced. Read when a graph is
    partitioned, so it is set before the first pass and kept until the step is closed."""
    if budget is None:
        return None
    import torch._functorch.config as functorch_config

    previous = float(functorch_config.activation_memory_budget)
    functorch_config.activation_memory_budget = budget
    return previous
