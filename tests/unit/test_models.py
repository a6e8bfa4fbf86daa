"""The tiny offline model: deterministic, cached, and loadable by transformers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from april_server.models import ensure_tiny_model  # noqa: E402

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache-a"))


def test_build_is_deterministic(tiny: Path, tmp_path: Path) -> None:
    other = ensure_tiny_model(tmp_path)
    assert other != tiny
    assert {p.name for p in tiny.iterdir()} == EXPECTED_FILES
    for name in sorted(EXPECTED_FILES):
        assert (tiny / name).read_bytes() == (other / name).read_bytes(), name


def test_second_call_uses_the_cache(tiny: Path) -> None:
    mtimes = {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()}
    start = time.perf_counter()
    again = ensure_tiny_model(tiny.parent.parent)
    assert time.perf_counter() - start < 0.1
    assert again == tiny
    assert {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()} == mtimes
    assert not [p for p in tiny.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_default_cache_root_follows_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from april_server.models import default_cache_root

    monkeypatch.setenv("APRIL_CACHE", str(tmp_path))
    assert default_cache_root() == tmp_path
    monkeypatch.delenv("APRIL_CACHE")
    assert default_cache_root() == Path.home() / ".cache" / "april-server"


def test_tokenizer(tiny: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    assert 400 <= len(tok) <= 500
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    for text in ["Compute 12 + 7. The answer is 19.", "Hello, wörld!\n\tline two 日本 ∑"]:
        ids = tok(text).input_ids
        assert tok.decode(ids) == text
    # the generated corpus made real merges: common words are one token
    assert len(tok(" the answer is").input_ids) == 3

    messages = [{"role": "user", "content": "What is 2+3?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(prompt).input_ids
    for special in ["<|im_start|>", "<|im_end|>"]:
        assert tok.convert_tokens_to_ids(special) in ids  # one token each, not split
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]


def test_model_forward_and_config(tiny: Path) -> None:
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["max_position_embeddings"] == 8192
    assert config["dtype"] == "float32"

    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    assert config["eos_token_id"] == tok.eos_token_id
    assert next(model.parameters()).dtype == torch.float32
    ids = tok("Compute 12 + 7.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()
    assert logits[0, -1].std() > 1.0  # spread logits, not the near-uniform 0.02 init


def test_greedy_generation_does_not_collapse(tiny: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    ids = tok("the people said", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=96, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    new = out[0, ids.shape[1] :].tolist()
    assert len(new) == 96
    assert len(set(new[-48:])) > 16  # still varied at the end, no short loop
    # lone UTF-8 bytes and controls are never picked: the text is plain and splits cleanly
    text = tok.decode(new)
    assert all(c == "\n" or " " <= c <= "~" for c in text.replace("<|im_end|>", ""))
    assert "".join(tok.decode([i]) for i in new) == text


def test_embedded_models_get_readable_names_unless_the_user_names_them() -> None:
    from april_server.cli import april_parser, build_argv

    april, rest = april_parser().parse_known_args(["--port", "1"])
    argv = build_argv(rest, april, cpu=False)
    assert argv[argv.index("--served-model-name") + 1] == "april-tiny"
    april, rest = april_parser().parse_known_args(["--served-model-name", "mine"])
    assert build_argv(rest, april, cpu=False).count("--served-model-name") == 1


def test_tiny_moe_is_a_deterministic_mixture_of_experts(tmp_path: Path) -> None:
    from april_server.models import ensure_tiny_moe

    a, b = ensure_tiny_moe(tmp_path / "a"), ensure_tiny_moe(tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (8, 2)
    model = AutoModelForCausalLM.from_pretrained(a).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    # the router spreads tokens: the 8 positions x 2 layers pick more than 2 distinct experts
    picked = {
        int(e) for logits in out.router_logits for e in logits.topk(2, dim=-1).indices.flatten()
    }
    assert len(picked) > 2


def test_tiny_moe_is_served_with_routed_experts_capture() -> None:
    from april_server.cli import april_parser, build_argv

    april, rest = april_parser().parse_known_args(["--april-model", "tiny-moe"])
    argv = build_argv(rest, april, cpu=False)
    assert "--enable-return-routed-experts" in argv
    assert argv[argv.index("--served-model-name") + 1] == "april-tiny-moe"
    april, rest = april_parser().parse_known_args([])
    assert "--enable-return-routed-experts" not in build_argv(rest, april, cpu=False)
