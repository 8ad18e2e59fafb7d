"""Serving a batch of requests as the knobs say, and timing each request's first and later tokens.

``ServeStep`` is to a ``ServingWorkload`` what ``TrainStep`` is to a training ``Workload``: built
once, then one call serves one batch. The batch's prompts are split into micro-batches; the lanes
(CUDA streams, CPU threads) take the micro-batches in turn, prefill each one (its requests' first
token), then decode all of theirs token by token, one forward per micro-batch and token. Smaller
micro-batches bring the first tokens of the early ones sooner and cost more, smaller, forwards.

Marks taken inside the step (CUDA events on the lane's stream, or the host clock) give each
micro-batch's time to first token from the start of the step and its time per output token after
that; ``take_phases`` reads them once the device is synchronised (after each timed window).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from search.core.knob_registry import GENERIC_KNOBS, knob_names
from search.execution.attention import attention_kernel
from search.execution.compiling import CompileStats, compiled, warm_up
from search.execution.fp8 import FP8_PRECISIONS
from search.execution.held import module_tensors, tensors_in
from search.execution.knobs import (
    AUTOCAST_DTYPES,
    MATMUL_PRECISIONS,
    KnobError,
    Knobs,
    build_model,
    concurrently,
    knobs_off_default,
    lane_threads,
    make_streams,
    refuse_unsupported,
)
from search.execution.marks import Mark, elapsed_ms, mark
from search.workloads.base import ServingWorkload, is_counting

__all__ = ["Generated", "Mark", "PHASES", "ServeStep"]

"""A point in a step: a recorded CUDA event, or the host clock (s) on a CPU."""

PHASES = ("ttft_ms", "tpot_ms")
"""The per-request times a serving step reports: time to first token, time per output token."""

_TRAINING_ONLY = tuple(name for name in GENERIC_KNOBS if name not in knob_names("serve"))
"""The generic knobs serving refuses away from their default (``search.core.knob_registry``)."""


@dataclass(frozen=True)
class Generated:
    """What one batch generated: tokens ``(batch, generation_length)`` and, when asked for, the
    logits each token was chosen from ``(batch, generation_length, vocab)``, fp32 on the CPU."""

    tokens: torch.Tensor
    logits: torch.Tensor | None


@dataclass(frozen=True)
class _Lane:
    """What one lane did in one batch."""

    marks: list[tuple[Mark, Mark]]
    """(first token, last token) of each of its micro-batches, in its order."""
    generated: list[tuple[torch.Tensor, torch.Tensor]]
    """Each micro-batch's tokens and logits (only when recorded)."""


class ServeStep:
    """One batch of requests served by ``workload`` on ``device``, executed as ``knobs`` say."""

    def __init__(
        self, workload: ServingWorkload, knobs: Knobs, device: torch.device, seed: int = 0
    ):
        if knobs.precision in FP8_PRECISIONS:
            # First: no device could serve it, whatever else refuse_unsupported would say.
            raise KnobError(
                f"precision={knobs.precision} does not apply to serving: it is torchao's float8 "
                "training (fp8 matrix products forward and backward); serve in bf16 or fp16"
            )
        refuse_unsupported(knobs, device)
        training_only = knobs_off_default(knobs, _TRAINING_ONLY)
        if training_only:
            raise KnobError(f"{training_only[0]} does not apply to serving (no backward pass)")
        self.workload, self.knobs, self.device = workload, knobs, device
        self.gen_len = workload.generation_length()
        self.items_per_step: int = knobs.batch_size * self.gen_len
        self.items_per_request = self.gen_len
        self.model: nn.Module = build_model(workload, device, seed).eval()
        generator = torch.Generator().manual_seed(seed)
        prompts = [
            workload.make_prompts(knobs.micro_samples, generator)
            for _ in range(knobs.n_micro_batches)
        ]
        if device.type == "cuda":
            prompts = [p.pin_memory() for p in prompts]
        self._lane_prompts = [prompts[lane :: knobs.streams] for lane in range(knobs.streams)]
        self._autocast_dtype = AUTOCAST_DTYPES.get(knobs.precision)
        self._streams = make_streams(knobs.streams, device)
        self._previous_matmul_precision = torch.get_float32_matmul_precision()
        self._lanes = lane_threads(knobs.streams)
        self._marks: list[tuple[Mark, list[tuple[Mark, Mark]]]] = []
        self._eager_forward = workload.forward
        self._forward = compiled(self._eager_forward, knobs.compile)
        self.compile_stats: CompileStats | None = None
        """What compiling took (``compile`` on); None when the step runs eagerly."""
        if knobs.compile != "off":
            self._compile(knobs.compile)

    def _compile(self, mode: str) -> None:
        """Serve the batch once, untimed: prefill and every decoding length compile here (a new
        length may recompile until the compiler makes it dynamic)."""
        try:
            self.compile_stats = warm_up(self, mode, self.device)
        except BaseException:
            self.close()  # no `with` block will: the constructor did not return
            raise
        self._marks.clear()

    def held_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor the step keeps between steps: the model's and the prompts
        (``search.execution.held``)."""
        yield from module_tensors(self.model)
        yield from tensors_in(self._lane_prompts)

    def __call__(self) -> None:
        """Serve the batch once. On CUDA it does not synchronize, so the caller can time it."""
        start = self._mark()
        lanes = self._run(None, record=False)
        self._marks.append((start, [m for lane in lanes for m in lane.marks]))

    def counted_parts(self) -> list[tuple[int, Callable[[], object]]]:
        """The step as the parts its work is counted from (``search.analysis.diagnosis
        .count_work``), each with how many times a call runs it: the whole call once."""
        return [(1, self)]

    def take_phases(self) -> dict[str, list[float]]:
        """Each micro-batch's time to first token and time per output token, ms, for the calls
        since the last take (one value per micro-batch stands for each of its requests). Call it
        with the device synchronised."""
        out: dict[str, list[float]] = {name: [] for name in PHASES}
        for start, micro_batches in self._marks:
            for first, end in micro_batches:
                out["ttft_ms"].append(elapsed_ms(start, first))
                if self.gen_len > 1:
                    out["tpot_ms"].append(elapsed_ms(first, end) / (self.gen_len - 1))
        self._marks.clear()
        return {name: values for name, values in out.items() if values}

    def generate(self, forced: torch.Tensor | None = None) -> Generated:
        """The batch's tokens and logits, fp32 on the CPU; ``forced`` ``(batch, generation_length)``
        decodes those tokens instead of the argmax (teacher forcing), so that logits can be
        compared with another configuration's position by position."""
        lanes = self._run(forced, record=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # micro-batch i is the (i // streams)-th of lane i % streams
        order = [
            lanes[i % self.knobs.streams].generated[i // self.knobs.streams]
            for i in range(self.knobs.n_micro_batches)
        ]
        tokens = torch.cat([t for t, _ in order]).cpu()
        logits = torch.cat([lg for _, lg in order]).to("cpu", torch.float32)
        return Generated(tokens, logits)

    def close(self) -> None:
        """Restore the float32 matmul precision found at construction; stop the lane threads."""
        torch.set_float32_matmul_precision(self._previous_matmul_precision)
        for lane in self._lanes:
            lane.shutdown()

    def __enter__(self) -> ServeStep:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self, forced: torch.Tensor | None, record: bool) -> list[_Lane]:
        torch.set_float32_matmul_precision(MATMUL_PRECISIONS[self.knobs.precision])
        cuda_streams = [s for s in self._streams if s is not None]
        if cuda_streams:
            main = torch.cuda.current_stream(self.device)
            for stream in cuda_streams:
                stream.wait_stream(main)  # the last batch's work must end first
        compiled = self.knobs.compile != "off"
        with attention_kernel(self.knobs.attention, compiled):  # the process's: see TrainStep
            lanes = concurrently(
                self._lanes,
                [
                    functools.partial(self._serve_lane, lane, forced, record)
                    for lane in range(self.knobs.streams)
                ],
            )
        for stream in cuda_streams:
            main.wait_stream(stream)
        return lanes

    def _serve_lane(self, lane: int, forced: torch.Tensor | None, record: bool) -> _Lane:
        """Prefill this lane's micro-batches, then decode them token by token, one forward per
        micro-batch and token: marks ``(first token, last token)`` per micro-batch and, with
        ``record``, each one's tokens and logits."""
        stream = self._streams[lane]
        mine = range(lane, self.knobs.n_micro_batches, self.knobs.streams)
        size = self.knobs.micro_samples
        forced_lane = None if forced is None else [forced[i * size : (i + 1) * size] for i in mine]
        # Work is counted on the eager function: the counters see every operator.
        forward = self._eager_forward if is_counting() else self._forward
        with (
            torch.cuda.stream(stream) if stream is not None else nullcontext(),
            torch.inference_mode(),
            # Autocast is thread-local, so each lane enters it; its weight-cast cache is one map
            # for the process, so with several lanes each casts its own (see TrainStep).
            torch.autocast(
                self.device.type,
                dtype=self._autocast_dtype,
                enabled=self._autocast_dtype is not None,
                cache_enabled=self.knobs.streams == 1,
            ),
        ):
            states, tokens, firsts = [], [], []
            kept: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
            for i, prompts in enumerate(self._lane_prompts[lane]):
                prompts = prompts.to(self.device, non_blocking=True)
                logits, state = forward(self.model, prompts, None)
                tokens.append(self._next(logits, forced_lane, i, 0))
                firsts.append(self._mark())
                states.append(state)
                kept.append(([tokens[i]], [logits.float()]) if record else ([], []))
            for position in range(1, self.gen_len):
                for i in range(len(states)):
                    logits, states[i] = forward(self.model, tokens[i][:, None], states[i])
                    tokens[i] = self._next(logits, forced_lane, i, position)
                    if record:
                        kept[i][0].append(tokens[i])
                        kept[i][1].append(logits.float())
            end = self._mark()
        generated = [(torch.stack(t, dim=1), torch.stack(lg, dim=1)) for t, lg in kept if record]
        return _Lane([(first, end) for first in firsts], generated)

    @staticmethod
    def _next(
        logits: torch.Tensor, forced: list[torch.Tensor] | None, i: int, position: int
    ) -> torch.Tensor:
        """Greedy decoding: the most likely token, or the forced one (on the same device)."""
        if forced is None:
            return logits.argmax(dim=-1)
        return forced[i][:, position].to(logits.device)

    def _mark(self) -> Mark:
        return mark(self.device)
