"""Serving: the GPT serving workload, its KV-cache knob, micro-batched prefill over lanes, the
per-request times, and fidelity against the plain fp32 reference."""

from __future__ import annotations

import threading

import pytest
import torch

from search.execution.fidelity import check_fidelity
from search.execution.knobs import KnobError, Knobs
from search.execution.serving import ServeStep
from search.workloads import GPTServe

CPU = torch.device("cpu")
TINY = dict(vocab_size=97, prompt_len=12, gen_len=5, d_model=32, n_layers=2, n_heads=4)


def serve(kv_cache: bool = True, **knobs) -> ServeStep:
    return ServeStep(GPTServe(**TINY, kv_cache=kv_cache), Knobs(**knobs), CPU, seed=0)


def forward_lengths(step: ServeStep) -> list[int]:
    """The number of positions each forward of one served batch ran on."""
    seen: list[int] = []
    hook = step.model.tok_emb.register_forward_hook(
        lambda m, args, out: seen.append(args[0].shape[1])
    )
    try:
        step()
    finally:
        hook.remove()
    return seen


def test_a_kv_cache_runs_one_position_per_token_and_no_cache_the_whole_prefix():
    with serve(kv_cache=True, batch_size=2) as cached, serve(kv_cache=False, batch_size=2) as plain:
        assert forward_lengths(cached) == [12, 1, 1, 1, 1]
        assert forward_lengths(plain) == [12, 13, 14, 15, 16]


def test_both_caches_generate_the_same_tokens_and_logits():
    with serve(kv_cache=True, batch_size=4) as cached, serve(kv_cache=False, batch_size=4) as plain:
        a, b = cached.generate(), plain.generate()
    assert a.tokens.shape == (4, 5) and a.logits is not None and b.logits is not None
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.logits, b.logits, rtol=1e-4, atol=1e-5)


def test_micro_batches_are_prefilled_one_by_one_and_decoded_in_turn():
    with serve(batch_size=4, micro_batch_size=2) as step:
        # two prefills of the prompt, then a forward per micro-batch and token
        assert forward_lengths(step) == [12, 12] + [1] * 8
        phases = step.take_phases()
    # one time to first token and one time per output token per micro-batch
    assert len(phases["ttft_ms"]) == 2 and len(phases["tpot_ms"]) == 2
    first, second = phases["ttft_ms"]
    assert 0 < first < second  # the second micro-batch's prompts wait for the first's prefill
    assert all(t > 0 for t in phases["tpot_ms"])
    assert step.take_phases() == {}  # taken once


def test_lanes_serve_their_micro_batches_on_threads_of_their_own():
    threads: set[int] = set()
    with serve(batch_size=4, micro_batch_size=1, streams=2) as step:
        step.model.tok_emb.register_forward_hook(lambda *_: threads.add(threading.get_ident()))
        step()
        assert len(step.take_phases()["ttft_ms"]) == 4
    assert len(threads) == 2 and threading.get_ident() not in threads


def test_the_order_of_micro_batches_over_lanes_does_not_change_what_is_generated():
    with serve(batch_size=4) as whole, serve(batch_size=4, micro_batch_size=1, streams=2) as lanes:
        a, b = whole.generate(), lanes.generate()
    # micro-batches draw their prompts one after another: the same prompts as one batch of 4
    assert torch.equal(a.tokens, b.tokens)


def test_recompute_does_not_apply_to_serving():
    with pytest.raises(KnobError, match="recompute"):
        serve(batch_size=2, recompute=True)


@pytest.mark.parametrize(
    "knobs",
    [
        Knobs(batch_size=4),
        Knobs(batch_size=4, micro_batch_size=2, streams=2),
        Knobs(batch_size=4, precision="bf16"),
        Knobs(batch_size=4, micro_batch_size=1, precision="bf16", streams=2),
    ],
    ids=["fp32", "fp32-lanes", "bf16", "bf16-lanes"],
)
def test_configurations_match_the_uncached_fp32_reference(knobs):
    report = check_fidelity(GPTServe(**TINY, kv_cache=True), knobs, CPU, seed=1)
    assert report.ok, report.reason
    assert set(report.errors) == {"fidelity_logits_rel_error", "fidelity_token_agreement"}


class ForgetsPositions(GPTServe):
    """A broken cache: every decoded token is placed at position 0."""

    def forward(self, model, tokens, state):
        if state is None:
            return super().forward(model, tokens, state)
        empty = [(k[:, :, :0], v[:, :, :0]) for k, v in state]
        logits, fresh = super().forward(model, tokens, empty)
        return logits, [
            (torch.cat([k, fk], 2), torch.cat([v, fv], 2))
            for (k, v), (fk, fv) in zip(state, fresh, strict=True)
        ]


def test_a_broken_cache_fails_fidelity():
    report = check_fidelity(ForgetsPositions(**TINY), Knobs(batch_size=4), CPU, seed=1)
    assert not report.ok
    assert "logits" in report.reason
