"""The order's moves for the levers that change how a step executes, right after precision:
the compiler, then the optimizer's implementation and the attention kernel, then fused kernels and
fp8 where they can gain.

Each is tried once, at the fastest configuration so far, so that the rest of the order starts from
whichever won; each move's line says why it is tried where it is. The model-based sampler and the
local search around the front take up whatever is left.

- **The compiler's** ``default`` mode is always worth one trial: it fuses the step's elementwise
  work whatever the regime. Its other modes replay CUDA graphs (``reduce-overhead``) or autotune
  the kernels (``max-autotune``); they are tried here only where the host bounds the step (twice
  the micro-batch cost little more time), where launch overhead is what there is to win.
- **The optimizer's** implementations (``for-loop``, ``foreach``, ``fused``): each once.
- **The attention kernels** (``math``, ``flash``, ``efficient``, ``cudnn``): each once per
  precision of the best so far, whatever the regime. torch's own pick per call is not always the
  fastest: on the 2-core CPU its flash kernel's backward took a third of the compiled ``llm`` step,
  and the math decomposition ran the compiled step at 1.18x.
- **Fused kernels and fp8** trade Triton kernels or casts for fewer bytes and FLOPs; both lose
  where the host bounds the step (small matrix products, too little work per kernel), so they are
  tried only where it does not. Fused kernels come first: on an H100 at the llama preset's wall,
  Liger's kernels with fused AdamW ran 1.38x the eager first guess and needed 16 GB less, while
  fp8 ran 0.49x eager. fp8 is tried compiled where the space can compile: torchao's casts and
  scales are separate kernels unless the compiler fuses them into their neighbours, which is
  where its published gains were measured. fp8 precisions whose layer sizes cannot gain
  (torchao's size rules) fail at once when built, at the cost of a process start.
"""

from __future__ import annotations

from collections.abc import Iterator

from search.analysis.pareto import throughputs_tie
from search.core.knob_registry import levers_on
from search.execution.fp8 import FP8_PRECISIONS
from search.strategy.book import Book, Seen
from search.strategy.move import Move, overhead_bound_near

__all__ = ["attention", "compiler", "fp8", "fused_kernels", "optimizer"]

CHEAP_COMPILE_MODES = ("default",)
"""Compile modes tried whatever the regime."""


def _stacked(best: Seen, knob: str) -> str:
    """What the move stacks on, for its line: the levers the best so far has on, ``knob``'s
    own aside (``levers_on``); '' where it runs the plain step."""
    on = [f"{k}={best.config[k]}" for k in levers_on(best.config) if k != knob]
    return f", stacked on {', '.join(on)}" if on else ""


def _host_bound(book: Book, best: Seen) -> bool:
    return overhead_bound_near(book, best.config)


def compiler(book: Book) -> Iterator[Move]:
    """``default`` at the fastest configuration so far, and at each eager one of another precision
    that ties it (``_tied_precisions``); each other mode at the fastest too where the host bounds
    the step."""
    best = book.best()
    if best is None or "compile" not in book.discrete:
        return
    for mode in book.ladder("compile"):
        # Once per precision: the compiled kernels differ by precision, so where another one
        # became the fastest (fp32 over a CPU's slow bf16, say) the compiler is tried again.
        if mode == "off" or book.tried("compile", mode, precision=best.config.get("precision")):
            continue
        if mode in CHEAP_COMPILE_MODES:
            yield Move(
                {**best.config, "compile": mode},
                f"the compiler: {mode} at the best so far{_stacked(best, 'compile')}",
            )
        elif _host_bound(book, best):
            yield Move(
                {**best.config, "compile": mode},
                f"the compiler: {mode} at the best so far{_stacked(best, 'compile')}, where the "
                "host bounds the step (twice the micro-batch cost little more time)",
            )
    yield from _tied_precisions(book, best)


def _tied_precisions(book: Book, best: Seen) -> Iterator[Move]:
    """The compiler's ``default`` at each eager configuration of another precision that ties the
    best so far run eagerly (``throughputs_tie``; the best itself where it runs eagerly, or where
    its eager twin was not measured): which precision the compiler speeds up most is the
    device's (on the AMX CPU fp32 and bf16 ran within noise of each other eagerly, and bf16
    compiled at about 1.4x fp32 compiled), and a tie chose the precision by a coin."""
    if "default" not in book.ladder("compile") or "precision" not in book.discrete:
        return
    twin = {**best.config, "compile": "off"}
    eager = next((s for s in book.complete if s.config == twin), best)
    for s in book.complete:
        precision = s.config.get("precision")
        if (
            precision == best.config.get("precision")
            or s.config.get("compile") != "off"
            or book.tried("compile", "default", precision=precision)
            or not throughputs_tie(s.figures, eager.figures)
        ):
            continue
        yield Move(
            {**s.config, "compile": "default"},
            f"the compiler: default at {precision}, which ties the best so far eagerly"
            f"{_stacked(s, 'compile')}",
        )


def optimizer(book: Book) -> Iterator[Move]:
    """Each implementation of the optimizer the space searches, once, at the best so far."""
    best = book.best()
    if best is None or "optimizer" not in book.discrete:
        return
    yield from _each_once(book, best, "optimizer", "the optimizer: {} at the best so far{}")


def attention(book: Book) -> Iterator[Move]:
    """Each attention kernel the space searches, once per precision, at the best so far, whatever
    the regime: which kernel is fastest depends on the device and the shapes, and torch's own pick
    was not on a CPU (``search.execution.attention``)."""
    best = book.best()
    if best is None or "attention" not in book.discrete:
        return
    # Once per precision, as the compiler is: a kernel's half-precision path is other code than
    # its fp32 one, and on CUDA flash and cuDNN take no fp32 input at all, so a kernel refused at
    # an fp32 best (infeasible, not run) is still measured once a half precision is the fastest.
    yield from _each_once(
        book,
        best,
        "attention",
        "the attention kernel: {} at the best so far{}",
        plain="default",
        same={"precision": best.config.get("precision")},
    )


def fp8(book: Book) -> Iterator[Move]:
    """Each fp8 precision the space searches, once, at the best so far, where the host does not
    bound the step (fp8's casts cost what its matrix products save only where they dominate);
    compiled where the space can compile (``_compiled_for_fp8``)."""
    best = book.best()
    if best is None or "precision" not in book.discrete or _host_bound(book, best):
        return
    compiled = _compiled_for_fp8(book, best)
    for precision in book.ladder("precision"):
        if precision in FP8_PRECISIONS and not book.tried("precision", precision):
            config = {**best.config, "precision": precision, **compiled}
            how = f"; compiled ({config['compile']}): its casts fuse only so" if compiled else ""
            yield Move(
                config,
                f"{precision}: fp8 matrix products at the best so far"
                f"{_stacked(best, 'precision')}, whose step the host does not bound{how}",
            )


def _compiled_for_fp8(book: Book, best: Seen) -> dict[str, str]:
    """``{"compile": mode}`` where fp8 should run compiled and the best so far runs eager: its
    ``default`` mode, or the first mode the space searches; {} where it compiles already or the
    space cannot compile."""
    if best.config.get("compile", "off") != "off" or "compile" not in book.discrete:
        return {}
    modes = [m for m in book.ladder("compile") if m != "off"]
    if not modes:
        return {}
    return {"compile": "default" if "default" in modes else modes[0]}


def fused_kernels(book: Book) -> Iterator[Move]:
    """Each set of fused kernels the space searches, once, at the best so far, where the host
    does not bound the step (a fused kernel saves memory traffic, not launches)."""
    best = book.best()
    if best is None or "kernels" not in book.discrete or _host_bound(book, best):
        return
    yield from _each_once(
        book,
        best,
        "kernels",
        "fused kernels: {} at the best so far{}, whose step the host does not bound",
        plain="torch",
    )


def _each_once(
    book: Book,
    best: Seen,
    knob: str,
    why: str,
    plain: object = None,
    same: dict[str, object] | None = None,
) -> Iterator[Move]:
    """Each value of ``knob`` the space searches but ``plain`` (the step as written), not tried
    yet (with the values ``same`` gives for other knobs), at ``best``; ``why`` says so, its two
    ``{}`` standing for the value and what it is stacked on (``_stacked``)."""
    for value in book.ladder(knob):
        if value != plain and not book.tried(knob, value, **(same or {})):
            yield Move({**best.config, knob: value}, why.format(value, _stacked(best, knob)))
