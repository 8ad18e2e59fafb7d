"""The search order an expert follows, as a function of what the study has seen.

``next_move(space, seen, busy, slo)`` returns the configuration to measure next and, in a few
words, why; None once the order has nothing left to propose (a model-based sampler takes over,
``search.strategy.guided``). It reads only plain values, so a resumed study, several workers and the
simulator (``benchmarks/sampler_choice.py``) get the same answer from the same history.

The order, each step skipped once everything it would propose was measured, is certain to run out
of memory, breaks a constraint or is being measured by another process:

1. **The expert's first guess**: the lowest precision that computes the same (bf16, then fp16,
   tf32, fp32, never fp8; a precision that failed the fidelity check is passed over), the largest
   batch, one lane, no recompute, eager, torch's own optimizer, kernels and attention kernel, and
   the largest micro-batch that fits, found by bisection over the OOM wall: the largest first,
   then halfway between the largest that fitted and the smallest that did not. With no
   micro-batch fitting at a batch, the next smaller batch.
2. **The other 16-bit precision** (fp16 for bf16, and back) at the best so far, once; **fp32**
   there once, at half its micro-batch (lower precision is fast only where the device has the
   units for it: not on a CPU without bf16 instructions), and where fp32 won by less than 2x, the
   first guess's precision at fp32's micro-batch (the micro-batch alone can win); then **the
   levers**
   (``search.strategy.lever_moves``), each once at the best so far (the compiler and the attention
   kernels once per precision): the compiler's ``default`` mode, at each precision that ties
   the best eagerly too (its other modes only where the host bounds the step), each
   implementation of the optimizer,
   each attention kernel, then fused kernels and fp8 precisions (compiled, where the space can
   compile) where the host does not bound the step. The rest of the order starts from whichever
   won.
3. **The wall re-opened by the levers**: the micro-batch above the best so far, at its levers,
   where the memory model predicts it within 15% of the largest peak a trial has held (the
   compiler and fused kernels hold fewer activations than the eager step the wall was found
   with). **The least recompute that lets a larger micro-batch fit**: at the micro-batch just
   above the wall, the space's recompute settings from the least recomputed up (as it lists them:
   a part of every block, every K-th block, all), each until one fits; not where doubling the
   micro-batch below the wall gained less than recompute costs (``RECOMPUTE_PAYS``). Then **each
   other precision's own wall**, bisected where it ran out of memory: bf16's activations take
   half of fp32's, so bf16's wall is not fp32's.
4. **The best inner configuration of each batch size**, from the largest down (the throughput-
   latency front): at the largest batch, micro-batch sweeps from the largest that fits down, on
   more lanes and on one, each until it has passed its peak (or twice fallen clearly behind the
   best so far); a smaller batch starts from the best inner configuration of the batch above
   it; each batch's best with the most recompute (the memory end of the front) and, where that
   saved memory, the largest batch's best with each other recompute setting (points between the
   ends); then each smaller batch climbs to better neighbours (micro-batch halved or doubled,
   lanes, both at once) until none is better. The regime orders the neighbours: where doubling
   the micro-batch cost little time (overhead-bound) larger micro-batches and more lanes come
   first; otherwise lanes and smaller micro-batches.
5. **Local search around the front**: each configuration on the Pareto front of what was
   measured, one knob a step away (any knob, the workload's own too).

Floats are not the order's to choose: they are drawn by the model-based sampler on every trial.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from search.analysis.pareto import throughputs_tie
from search.core.knob_registry import levers_on
from search.core.records import COMPLETE
from search.space.params import FloatParam, IntParam
from search.space.search_space import SearchSpace
from search.strategy import lever_moves
from search.strategy.book import Book, Seen, config_key
from search.strategy.memory_moves import (
    precision_walls,
    recompute_between,
    recompute_past_the_wall,
    reopened_wall,
    with_recompute,
)
from search.strategy.move import Move, bisect_wall, feasible_micro, ladder_step, overhead_bound

__all__ = ["Move", "next_move"]


def next_move(
    space: SearchSpace,
    seen: Sequence[Seen],
    busy: Sequence[Mapping[str, Any]] = (),
    slo: Mapping[str, float] | None = None,
) -> Move | None:
    """The first move of the order (module docstring) that is still open; None when none is."""
    book = Book(space, seen, busy, slo or {})
    for move in _order(book):
        if book.is_open(move.config):
            return move
    return None


# -- the order ---------------------------------------------------------------------------------


def _order(book: Book) -> Iterator[Move]:
    first = _first_guess(book)
    if first is not None:
        yield first
        return  # the opening is sequential: each step needs the one before it
    yield from _precision_peer(book)
    yield from _reference_precision(book)
    yield from _opening_precision_at_its_micro(book)
    yield from lever_moves.compiler(book)
    yield from lever_moves.optimizer(book)
    yield from lever_moves.attention(book)
    yield from lever_moves.fused_kernels(book)
    yield from lever_moves.fp8(book)
    yield from reopened_wall(book)
    yield from recompute_past_the_wall(book)
    yield from precision_walls(book)
    yield from _batches(book)
    yield from _local_search(book)


_PLAIN = {"compile": "off", "optimizer": "default", "kernels": "torch", "attention": "default"}
"""The expert's first guess runs the step as written: eager, torch's own optimizer and kernels,
and torch's own pick of attention kernel."""


def _opening_base(book: Book) -> dict[str, Any]:
    """Every searched discrete knob at the expert's value: one lane, no recompute, no compiler,
    the lowest precision that computes the same, a workload's own knobs at their first value."""
    base: dict[str, Any] = {}
    for knob in book.discrete:
        values = book.ladder(knob)
        if knob == "precision":
            base[knob] = book.precision()
        elif knob == "recompute" and book.no_recompute() is not None:
            base[knob] = book.no_recompute()
        elif knob in _PLAIN and _PLAIN[knob] in values:
            base[knob] = _PLAIN[knob]
        else:
            base[knob] = values[0]
    return {**base, **book.space.fixed, **_floats(book.space)}


def _floats(space: SearchSpace) -> dict[str, Any]:
    """A stand-in value for each float knob (drawn elsewhere), so that the space's constraints
    can be checked on a move."""
    return {k: p.low for k, p in space.searched.items() if isinstance(p, FloatParam)}


def _first_guess(book: Book) -> Move | None:
    """The next step of the opening bisection, or None once the wall is found at some batch."""
    base = _opening_base(book)
    if "batch_size" not in book.discrete:
        return None if book.outcome(base) is not None else Move(base, "the expert's first guess")
    for batch in reversed(book.ladder("batch_size")):
        at_batch = {**base, "batch_size": batch}
        if "micro_batch_size" not in book.discrete:
            if book.outcome(at_batch) is None:
                return Move(at_batch, "the expert's first guess: the largest batch")
            if book.outcome(at_batch) == COMPLETE:
                return None
            continue
        micros = [m for m in book.ladder("micro_batch_size") if feasible_micro(book, at_batch, m)]
        step = bisect_wall(book, at_batch, micros)
        if step is not None:
            return step
        if any(book.outcome({**at_batch, "micro_batch_size": m}) == COMPLETE for m in micros):
            return None  # the wall is found at this batch
    return None


PEERS = {"bf16": "fp16", "fp16": "bf16"}
"""Precisions as narrow as each other: which one is faster depends on the device (fp16 needs a
loss scaler, bf16 does not), so an expert tries the other once the first guess stands."""


def _precision_peer(book: Book) -> Iterator[Move]:
    """The fastest configuration so far in the other 16-bit precision, where the space has it."""
    best = book.best()
    if best is None or "precision" not in book.discrete:
        return
    peer = PEERS.get(best.config["precision"])
    if peer in book.ladder("precision") and not book.tried("precision", peer):
        yield Move(
            {**best.config, "precision": peer},
            f"{peer}: as few bits as {best.config['precision']}; which is faster here?",
        )


def _reference_precision(book: Book) -> Iterator[Move]:
    """fp32 once, at the fastest configuration so far with half its micro-batch, where that one
    runs a lower precision: lower precision is fast only where the device has the units for it
    (on a CPU without bf16 instructions a bf16 matrix product ran at 1% of fp32's speed). Half the
    micro-batch, as fp32's activations take twice the memory: the check must not run out of it."""
    best = book.best()
    if best is None or "precision" not in book.discrete or "fp32" not in book.ladder("precision"):
        return
    if best.config["precision"] == "fp32" or book.tried("precision", "fp32"):
        return
    config = {**best.config, "precision": "fp32"}
    if "micro_batch_size" in book.discrete:
        config["micro_batch_size"] = (
            ladder_step(book, "micro_batch_size", best.config["micro_batch_size"], -1)
            or best.config["micro_batch_size"]
        )
    if "streams" in book.discrete:
        config["streams"] = book.ladder("streams")[0]
    yield Move(
        config,
        f"fp32 at half the micro-batch: is {best.config['precision']} faster on this device?",
    )


PRECISION_CLEAR = 2.0
"""How far fp32 must lead the opening's precision for the lead to be the device's, not the
micro-batch's: on the CPU without bf16 instructions it led by 12x; on the one with AMX by 1.17x
at half the micro-batch, where the micro-batch alone moved the compiled fp32 step by up to 1.2x
(micro-batches 4 to 16, one run)."""


def _opening_precision_at_its_micro(book: Book) -> Iterator[Move]:
    """Where fp32 is the best so far (its check at half the micro-batch won), the opening's
    precision at fp32's micro-batch and lanes: the check differed from the first guess in
    micro-batch too, and the micro-batch alone can win. In the default llm run on the 2-core
    Intel Xeon with AMX, fp32 at micro-batch 16 (14.7k tokens/s) beat bf16 at 32 (12.6k), the run
    went on in fp32, and bf16 was never measured at 16: compiled, bf16 at micro-batch 32 ran
    within noise of the fp32 recommendation, and bf16 at 8 at 1.5x it in an earlier run."""
    best = book.best()
    if best is None or "precision" not in book.discrete or best.config["precision"] != "fp32":
        return
    opening = book.precision()
    if opening == "fp32" or levers_on(best.config):
        return  # the levers compare precisions themselves (``lever_moves._tied_precisions``)
    first = [s for s in book.complete if s.config.get("precision") == opening]
    fastest = max((s.figures.get("throughput", 0.0) for s in first), default=0.0)
    if fastest * PRECISION_CLEAR < (book.throughput(best.config) or 0.0):
        return  # so far ahead that no micro-batch explains it: a device without the units
    micro = best.config.get("micro_batch_size")
    yield Move(
        {**best.config, "precision": opening},
        f"{opening} at fp32's micro-batch{f' {micro}' if micro else ''}: which precision is "
        "faster, the rest the same?",
    )


def _batches(book: Book) -> Iterator[Move]:
    """The largest batch's micro-batch sweeps, then each smaller batch's start (carried from the
    batch above), each batch's best with recompute (the other settings between, at the largest),
    then the smaller batches' climbs: the
    throughput end of the front first, then its latency end, then its memory end."""
    if "batch_size" not in book.discrete:
        yield from _sweeps(book, None)
        yield from _climb(book, None)
        return
    batches = list(reversed(book.ladder("batch_size")))
    yield from _sweeps(book, batches[0])
    yield from _climb(book, batches[0])
    for above, batch in zip(batches, batches[1:], strict=False):
        if book.best(batch) is None:
            start = _carried(book, above, batch)
            if start is not None:
                yield start
    for batch in batches:
        yield from with_recompute(book, batch)
    yield from recompute_between(book, batches[0])
    for batch in batches[1:]:
        yield from _climb(book, batch)


def _sweeps(book: Book, batch: Any) -> Iterator[Move]:
    """Micro-batches from the largest that fits down, on as many lanes as each allows and then
    on one lane, each sweep until it has passed its peak (``PAST_THE_PEAK`` falls in a row):
    the best micro-batch depends on the batch, and too small a one leaves the device idle."""
    if "micro_batch_size" not in book.discrete:
        return
    best = book.best(batch)
    if best is None:
        return
    top = max(
        (s.config for s in book.complete if s.config.get("batch_size") == batch),
        key=lambda c: c["micro_batch_size"],
    )
    lanes = "streams" in book.discrete
    for many in (True, False) if lanes else (False,):
        # the sweep's start counts toward its peak where it was measured on these lanes
        figures = _start_figure(
            book, {**best.config, "micro_batch_size": top["micro_batch_size"]}, many
        )
        behind: list[bool] = []  # each measured step: clearly slower than the best so far
        micro = ladder_step(book, "micro_batch_size", top["micro_batch_size"], -1)
        while micro is not None and not _past_the_peak(figures) and not _left_behind(behind):
            config = {**best.config, "micro_batch_size": micro}
            if lanes:
                config["streams"] = _sweep_lanes(book, config, many)
            outcome = book.outcome(config)
            if outcome is None:
                shape = "on more lanes" if many and config.get("streams", 1) > 1 else "on one lane"
                where = f" at batch {batch}" if batch is not None else ""
                yield Move(config, f"micro-batch sweep: {micro} {shape}{where}")
                break
            if outcome == COMPLETE:
                figures.append(book.throughput(config) or 0.0)
                behind.append(_clearly_behind(book, config, best))
            micro = ladder_step(book, "micro_batch_size", micro, -1)


def _start_figure(book: Book, config: Mapping[str, Any], many: bool) -> list[float]:
    """The throughput of a sweep's start (its largest micro-batch), on the sweep's lanes, where
    measured: so a sweep that falls twice from there stops a micro-batch sooner."""
    if "streams" in book.discrete:
        streams = _sweep_lanes(book, config, many)
        if many and streams == book.ladder("streams")[0]:
            return []  # the start cannot run on more lanes: no figure of this sweep's
        config = {**config, "streams": streams}
    figure = book.throughput(config)
    return [figure] if figure is not None else []


def _sweep_lanes(book: Book, config: Mapping[str, Any], many: bool) -> Any:
    """The lanes a sweep runs ``config`` on: as many as it allows, or one."""
    return _most_lanes(book, config) if many else book.ladder("streams")[0]


PAST_THE_PEAK = 2
"""Falls in a row after which a micro-batch sweep stops: one can be noise, two are a trend."""


def _past_the_peak(figures: Sequence[float]) -> bool:
    tail = figures[-(PAST_THE_PEAK + 1) :]
    return len(tail) == PAST_THE_PEAK + 1 and all(
        a > b for a, b in zip(tail, tail[1:], strict=False)
    )


def _left_behind(behind: Sequence[bool]) -> bool:
    """Whether a sweep's last ``PAST_THE_PEAK`` steps were each clearly slower than the best so
    far: a smaller micro-batch feeds the device less, so a sweep that lost twice by more than
    the noise will not catch up further down. (Its own figures may wobble within their noise and
    never fall twice in a row: on the 2-core CPU, compiled on two lanes, micro-batches 16, 8 and
    4 read 19.9k, 18.4k and 19.6k tokens/s against one lane's 27.8k, each a cold compile.)"""
    tail = behind[-PAST_THE_PEAK:]
    return len(tail) == PAST_THE_PEAK and all(tail)


def _clearly_behind(book: Book, config: Mapping[str, Any], best: Seen) -> bool:
    """Whether ``config`` was measured slower than ``best`` by more than their intervals allow
    (False where either has no interval: nothing is clear without one)."""
    known = book.outcomes.get(config_key(config, book.discrete))
    bounds = ("throughput", "throughput_ci_low", "throughput_ci_high")
    if known is None or not all(k in f for k in bounds for f in (known.figures, best.figures)):
        return False
    slower = known.figures["throughput"] < best.figures.get("throughput", 0.0)
    return slower and not throughputs_tie(known.figures, best.figures)


def _most_lanes(book: Book, config: Mapping[str, Any], at_most: Any = None) -> Any:
    """The most lanes (up to ``at_most``) the space allows ``config`` (its constraints, e.g.
    lanes <= micro-batches); the fewest where none is allowed."""
    ladder = book.ladder("streams")
    for streams in reversed(ladder):
        if at_most is not None and streams > at_most:
            continue
        if not book.space.violations({**config, "streams": streams}):
            return streams
    return ladder[0]


def _carried(book: Book, above: Any, batch: Any) -> Move | None:
    """The best inner configuration of ``above`` moved to ``batch`` (the micro-batch clipped to
    the batch, lanes to what it allows)."""
    best = book.best(above)
    if best is None:
        return None
    config = {**best.config, "batch_size": batch}
    if "micro_batch_size" in config:
        config["micro_batch_size"] = min(config["micro_batch_size"], batch)
    if "streams" in book.discrete:
        config["streams"] = _most_lanes(book, config, at_most=config["streams"])
    return Move(
        config, f"latency front: batch {batch} with the best inner configuration of batch {above}"
    )


def _climb(book: Book, batch: Any) -> Iterator[Move]:
    """The neighbours of the best configuration at ``batch`` without recompute, then of the best
    with it where that is faster: recompute is worth its extra forward pass only where it lets a
    larger micro-batch fit, so a lead it holds by noise must not steer the climb."""
    best = book.best(batch)
    if best is None:
        return
    plain = (book.best(batch, recompute=False) if "recompute" in book.discrete else None) or best
    for base in (plain, best) if best is not plain else (plain,):
        yield from _neighbours(book, base.config, batch)


def _neighbours(book: Book, config: Mapping[str, Any], batch: Any) -> Iterator[Move]:
    """``config``'s neighbours on micro-batch and lanes, the regime's direction first."""
    moves: list[tuple[str, dict[str, Any], str]] = []
    up, down = _shift(book, config, +1), _shift(book, config, -1)
    lanes = _lanes(book, config, +1)
    overhead = overhead_bound(book, config)
    where = f" at batch {batch}" if batch is not None else ""
    if up is not None:
        why = "overhead-bound: doubling micro-batch" if overhead else "larger micro-batch"
        moves.append(("up", up, why + where))
    if lanes is not None:
        moves.append(("lanes", lanes, "more lanes: the host may be the bottleneck" + where))
    if down is not None:
        down_lanes = _lanes(book, down, +1)
        if down_lanes is not None:
            moves.append(("down+lanes", down_lanes, "smaller micro-batch on more lanes" + where))
        moves.append(("down", down, "smaller micro-batch" + where))
    if not overhead:  # compute-bound or unknown: the larger micro-batch is the last resort
        moves.sort(key=lambda m: m[0] == "up")
    for _, move, why in moves:
        yield Move(move, why)


def _local_search(book: Book) -> Iterator[Move]:
    """Each front configuration's one-step neighbours, any discrete knob."""
    for s in book.front():
        for knob in book.discrete:
            values = book.ladder(knob)
            here = s.config[knob]
            if here not in values:
                continue
            i = values.index(here)
            numeric = isinstance(book.space.searched[knob], IntParam)
            others = (
                [values[j] for j in (i - 1, i + 1) if 0 <= j < len(values)]
                if numeric
                else [v for v in values if v != here]
            )
            for value in others:
                yield Move(
                    {**s.config, knob: value},
                    f"local search around a front configuration: {knob}={value}",
                )


def _shift(book: Book, config: Mapping[str, Any], by: int) -> dict[str, Any] | None:
    """``config`` with the micro-batch a step up or down (lanes cut back to what it allows)."""
    if "micro_batch_size" not in book.discrete:
        return None
    micro = ladder_step(book, "micro_batch_size", config["micro_batch_size"], by)
    if micro is None:
        return None
    moved = {**config, "micro_batch_size": micro}
    if "streams" in book.discrete:
        moved["streams"] = _most_lanes(book, moved, at_most=moved["streams"])
    return moved if book.fits(moved) else None


def _lanes(book: Book, config: Mapping[str, Any], by: int) -> dict[str, Any] | None:
    if "streams" not in book.discrete:
        return None
    streams = ladder_step(book, "streams", config["streams"], by)
    if streams is None:
        return None
    moved = {**config, "streams": streams}
    return moved if book.fits(moved) else None
