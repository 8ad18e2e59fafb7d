"""Any transformers model by name: built from its config alone, trained with its library's loss,
its knobs mapped onto its own layers, and what it cannot take dropped or refused in one line."""

from __future__ import annotations

import http.server
import json
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch
from invoke import completed_study
from invoke import search as invoke_search  # tests/ is on sys.path
from tiny_overrides import LENIENT, TINY_ANY_SPACE

from search.workloads.hf import HF

pytest.importorskip("transformers")

TINY_SIZES = dict(layers=1, width=32, heads=2, vocab_size=256, seq_len=32)
ARCHITECTURES = [
    ("llama", "causal-lm"),
    ("gpt2", "causal-lm"),
    ("qwen2", "causal-lm"),
    ("mistral", "causal-lm"),
    ("bert", "masked-lm"),
]


@pytest.mark.parametrize("model_type, head", ARCHITECTURES)
def test_each_architecture_trains_with_its_own_loss_and_names_its_layers(model_type, head):
    workload = HF(model=model_type, head=head, **TINY_SIZES)
    model = workload.build_model().train()
    batch = workload.make_batch(2, torch.Generator().manual_seed(0))
    loss = workload.loss(model, batch)
    assert loss.ndim == 0 and torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    layers = workload.recompute_modules(model)
    assert len(layers) == 1 and "attention" in workload.recompute_parts(model)
    assert workload.flops_per_item() > 6 * 32 * 32  # at least one width x width product


def test_a_part_an_architecture_lacks_is_refused_and_a_part_it_has_is_not():
    bert = HF(model="bert", head="masked-lm", **TINY_SIZES)
    assert "no mlp part" in bert.refuses("recompute", "mlp")
    assert bert.refuses("recompute", "attention") is None
    assert bert.refuses("attention", "math") is None  # BERT calls SDPA
    assert HF(model="gpt2", **TINY_SIZES).refuses("recompute", "mlp") is None


def test_sizes_keep_the_architecture_consistent():
    llama = HF(model="llama", layers=2, width=64, heads=4)
    c = llama.config
    assert llama.build_model().model.embed_tokens.weight.dtype == torch.float32
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == (2, 64, 4)
    assert c.num_key_value_heads == 4  # not the default's 32 heads' worth
    assert c.intermediate_size == round(11008 / 4096 * 64)  # Llama's ratio, at this width
    classify = HF(model="gpt2", head="sequence-classification", num_labels=3, **TINY_SIZES)
    batch = classify.make_batch(4, torch.Generator().manual_seed(0))
    assert batch["labels"].max() < 3
    assert classify.loss(classify.build_model(), batch).ndim == 0
    qwen = HF(model="qwen2", layers=3, width=32, heads=2, vocab_size=64)  # layer_types follow
    assert len(qwen.config.layer_types) == 3 and len(qwen.build_model().model.layers) == 3
    with pytest.raises(ValueError, match="has no no_such_setting"):
        HF(model="gpt2", settings={"no_such_setting": 1}, **TINY_SIZES)


def test_a_composite_config_is_refused_until_a_part_is_named_and_that_part_is_sized():
    # set on a vision-language config, the sizes would be ignored: Gemma 3's 26 text layers
    # 2,304 wide and its vision tower would be built on a CPU asked for one layer 32 wide
    with pytest.raises(
        ValueError,
        match=r"composite config \(text_config, vision_config\).*"
        r"space.workload.part=text_config",
    ):
        HF(model="gemma3", **TINY_SIZES)
    gemma = HF(model="gemma3", part="text_config", **TINY_SIZES)
    assert gemma.model_type == "gemma3_text"
    assert (gemma.config.num_hidden_layers, gemma.config.hidden_size) == (1, 32)
    model = gemma.build_model()
    assert type(model).__name__ == "Gemma3ForCausalLM" and len(gemma.recompute_modules(model)) == 1
    with pytest.raises(ValueError, match=r"no part 'audio_config' \(its parts: text_config"):
        HF(model="gemma3", part="audio_config", **TINY_SIZES)
    with pytest.raises(ValueError, match="it is not composite: drop part"):
        HF(model="gpt2", part="text_config", **TINY_SIZES)


def test_a_size_or_head_the_architecture_lacks_is_refused():
    # GPT-2 has no key-value heads of their own: the attribute would be set and never read
    with pytest.raises(ValueError, match="gpt2's config has no num_key_value_heads: drop kv_heads"):
        HF(model="gpt2", kv_heads=1, **TINY_SIZES)
    with pytest.raises(
        ValueError, match=r"no causal-lm model of t5 .*head=sequence-classification"
    ):
        HF(model="t5", **TINY_SIZES)
    # transformers logs to a stream of its own (bound when it was first imported), not through
    # the root logger: its records are read here, where the command line would print them
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warned.append  # type: ignore[method-assign]
    logging.getLogger("transformers").addHandler(handler)
    try:
        with pytest.raises(ValueError, match="no causal-lm model of qwen2_vl_text .*another model"):
            HF(model="qwen2_vl", part="text_config", **TINY_SIZES)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    # its token ids (151,643 and up) beyond the shrunk vocabulary were cleared before the config
    # was built again, whose checks would have warned of each: a refusal is one line
    assert [r.getMessage() for r in warned] == []


def test_a_local_config_json_builds_its_architecture(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({"model_type": "qwen2", "hidden_size": 48, "num_attention_heads": 4})
    )
    workload = HF(model=str(path), layers=1, vocab_size=128, seq_len=16)
    assert workload.model_type == "qwen2" and workload.config.hidden_size == 48


@pytest.mark.parametrize("model_type, head", ARCHITECTURES)
def test_a_four_trial_study_measures_recompute_and_attention_on_each(model_type, head, tmp_path):
    sizes = [f"space.workload.{k}={v}" for k, v in TINY_SIZES.items()]
    result = invoke_search(
        "+space=hf",
        f"model={model_type}",
        f"space.workload.head={head}",
        *sizes,
        *TINY_ANY_SPACE,
        *LENIENT,
        "space.params.batch_size.high=4",
        "space.params.micro_batch_size.high=4",
        "space.params.recompute.choices=[selective,attention]",
        "space.params.attention.choices=[math]",
        "study.n_trials=4",
        "measure.max_time_s=0.5",
        runs_dir=tmp_path / "runs",
    )
    done = completed_study(tmp_path / "runs", f"hf-{model_type}-cpu", result, trials=4)
    assert all(t.user_attrs["config"]["attention"] == "math" for t in done)
    assert {t.user_attrs["config"]["recompute"] for t in done} <= {"selective", "attention"}


def test_bad_model_names_are_one_line_and_exit_2(tmp_path):
    runs_dir = tmp_path / "runs"
    typo = invoke_search("+space=hf", "model=lama", "device=cpu", runs_dir=runs_dir, code=2)
    assert typo.stderr.count("\n") == 1 and "close: llama" in typo.stderr
    nothing = invoke_search("+space=hf", "device=cpu", runs_dir=runs_dir, code=2)
    assert "no model named" in nothing.stderr and nothing.stderr.count("\n") == 1
    ignored = invoke_search("+space=llm", "model=gpt2", "device=cpu", runs_dir=runs_dir, code=2)
    assert "builds its own model" in ignored.stderr and ignored.stderr.count("\n") == 1
    assert not runs_dir.exists()


def test_a_hub_name_with_no_network_is_one_line_and_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as a machine without network reads it
    monkeypatch.setitem(os.environ, "HF_HOME", str(tmp_path / "hf"))  # an empty cache
    result = invoke_search(
        "+space=hf", "model=someone/no-such-model", "device=cpu", runs_dir=tmp_path / "r", code=2
    )
    assert result.stderr.count("\n") == 1, result.stderr
    assert "could not be fetched from the hub" in result.stderr
    assert "pass a local config.json" in result.stderr


BUILD_BY_HUB_NAME = """
import sys
from search.workloads.hf import HF
for name in sys.argv[1:]:
    try:
        print(name, HF(model=name, layers=1, vocab_size=64).config.hidden_size)
    except ValueError as e:
        print(name, "refused", e)
"""


def built_by_hub_name(name: str, env: dict[str, str]) -> str:
    """What building the workload by the hub name ``name`` printed, in a fresh process (as a
    trial's) with ``env``."""
    run = subprocess.run(
        [sys.executable, "-c", BUILD_BY_HUB_NAME, name],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return run.stdout.strip()


class _Hub(http.server.BaseHTTPRequestHandler):
    """A hub that has nothing, and notes every request made of it."""

    asked: list[str] = []

    def do_HEAD(self):  # noqa: N802 (the standard library's name)
        self.asked.append(self.path)
        self.send_response(404)
        self.end_headers()

    do_GET = do_HEAD  # noqa: N815

    def log_message(self, *args):
        pass


def test_a_hub_name_s_config_once_fetched_is_read_from_the_cache_without_asking_the_hub(tmp_path):
    # as the hub's cache holds a config once fetched: a ref to a snapshot holding its config.json
    cached = tmp_path / "hf" / "hub" / "models--someone--tiny"
    (cached / "refs").mkdir(parents=True)
    (cached / "refs" / "main").write_text("abc123")
    (cached / "snapshots" / "abc123").mkdir(parents=True)
    config = {"model_type": "qwen2", "hidden_size": 48, "num_attention_heads": 4}
    (cached / "snapshots" / "abc123" / "config.json").write_text(json.dumps(config))
    _Hub.asked = []
    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_ENDPOINT": f"http://127.0.0.1:{hub.server_port}",
        "HF_HUB_OFFLINE": "0",
    }
    try:
        # every trial's process builds the workload: none asks the hub for a cached config
        assert built_by_hub_name("someone/tiny", env) == "someone/tiny 48"
        assert _Hub.asked == []
        # the control: a config not in the cache is asked of the hub (which has none)
        assert "refused" in built_by_hub_name("someone/other", env)
        assert any("someone/other" in path for path in _Hub.asked), _Hub.asked
    finally:
        hub.shutdown()


def test_each_model_has_a_study_of_its_own_named_as_a_folder_can_be(tmp_path):
    from search.config.compose import model_suffix

    assert model_suffix("gpt2") == "-gpt2" and model_suffix(None) == ""
    assert model_suffix("Qwen/Qwen2.5-0.5B") == "-Qwen--Qwen2.5-0.5B"
    (tmp_path / "tiny-qwen").mkdir()
    assert model_suffix(str(tmp_path / "tiny-qwen" / "config.json")) == "-tiny-qwen"
    assert model_suffix(str(tmp_path / "mine.json")) == "-mine"
    assert model_suffix(str(tmp_path / "tiny-qwen")) == "-tiny-qwen"
