"""[any] Offline pooling models: a Qwen3-Embedding, a Qwen3-Reranker and a Qwen3-VL embedding model.

Random weights in mlx-vlm's own classes, the Qwen tokenizer of qwen3_vl.py, files laid out as the published
checkpoints lay them out:

- ``text_embedder``: Qwen/Qwen3-Embedding's: config ``model_type`` ``qwen3`` (mlx-vlm's embedding loader reads it
  as ``qwen3_embedding``), sentence-transformers' ``modules.json`` and ``1_Pooling/config.json`` (last token);
  ``dimensions`` truncation allowed (Matryoshka), as the card says.
- ``reranker``: Qwen/Qwen3-Reranker's: a plain ``Qwen3ForCausalLM``; its kind is in its name (``*reranker*``), as
  on the Hub. ``yes`` and ``no`` are single tokens.
- ``vl_embedder``: Qwen/Qwen3-VL-Embedding's: the Qwen3-VL of qwen3_vl.py as ``model_type`` ``qwen3_vl_embedding``.
- ``cross_encoder``: cross-encoder/ms-marco-MiniLM's: a ``BertForSequenceClassification`` with one label, its
  tokenizer writing ``[CLS] query [SEP] document [SEP]`` with segment ids.

Each build lands whole in the shared model cache (build.py's ``publish``) and is reused.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .build import model_cache_dir

VERSION = 2  # 2: the reranker's weights in Hugging Face naming, as published
KINDS = ("text_embedder", "reranker", "vl_embedder", "cross_encoder")
_MARKER = "vlmserve_pooling_build.json"


def build_pooling_model(kind: str, seed: int = 0) -> Path:
    """The directory of one offline pooling model (``KINDS``), built once into the shared cache."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    name = "qwen3-reranker" if kind == "reranker" else kind.replace("_", "-")
    dest = model_cache_dir() / f"{name}-micro-seed{seed}-v{VERSION}"
    if (dest / _MARKER).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        {"text_embedder": _text_embedder, "reranker": _reranker, "vl_embedder": _vl_embedder,
         "cross_encoder": _cross_encoder}[kind](tmp, seed)
        (tmp / _MARKER).write_text(json.dumps({"kind": kind, "seed": seed, "version": VERSION}))
        try:
            tmp.rename(dest)
        except OSError:  # another builder won the race: its copy is the same
            pass
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _text_config(model_type: str, tied: bool) -> dict[str, Any]:
    from .qwen3_vl import DIMS, SPECIAL_TOKENS

    dims = DIMS["micro"]
    return {
        "model_type": model_type, "architectures": ["Qwen3ForCausalLM"], "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate, "num_hidden_layers": dims.layers, "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads, "head_dim": dims.head_dim, "hidden_act": "silu",
        "vocab_size": dims.vocab, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "tie_word_embeddings": tied, "bos_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"), "torch_dtype": "float32",
    }  # fmt: skip


def _tokenizer(template: str, extra: tuple[str, ...] = ()) -> Any:
    from .qwen3_vl import DIMS, published_template, qwen_tokens
    from .tokenizer import build_tokenizer

    tokenizer = build_tokenizer(qwen_tokens(DIMS["micro"], template or published_template("qwen3-vl-8b-instruct")))
    if extra:
        tokenizer.add_tokens([t for t in extra if len(tokenizer.encode(t, add_special_tokens=False)) != 1])
    tokenizer.model_max_length = 32768
    return tokenizer


def _weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    from .weights import instantiate, weight_tensors

    return weight_tensors(instantiate(config, seed), "float32")


def _save(path: Path, config: dict[str, Any], tensors: dict[str, Any]) -> None:
    from .weights import save_weights

    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_weights(tensors, path / "model.safetensors")


def _text_embedder(path: Path, seed: int) -> None:
    _tokenizer("").save_pretrained(str(path))
    config = _text_config("qwen3", tied=True)
    tensors = _weights({**config, "model_type": "qwen3_embedding"}, seed)
    _save(path, config, tensors)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": config["hidden_size"], "pooling_mode_lasttoken": True,
               "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": False, "include_prompt": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))


# Qwen3's chat template, the part a reranker prompt uses: system and user turns (the suffix opens the answer).
_QWEN3_TEXT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _reranker(path: Path, seed: int) -> None:
    tokenizer = _tokenizer(_QWEN3_TEXT_TEMPLATE, extra=("yes", "no"))
    tokenizer.save_pretrained(str(path))
    config = {**_text_config("qwen3", tied=True), "vocab_size": len(tokenizer)}  # room for added yes/no
    # Hugging Face's names (model.layers...), as published: mlx-vlm's chat and embedding loaders both read them
    tensors = {k.removeprefix("language_model."): v for k, v in _weights(config, seed).items()}
    _save(path, config, tensors)


def _vl_embedder(path: Path, seed: int) -> None:
    from .qwen3_vl import recipe

    plain = recipe("micro")
    processor = plain.make_processor(_tokenizer(""))
    processor.save_pretrained(str(path))
    config = {**plain.config, "model_type": "qwen3_vl_embedding", "architectures": ["Qwen3VLForEmbedding"]}
    model = _instantiate_fixed(config, plain, seed)
    from .weights import weight_tensors

    _save(path, config, weight_tensors(model, "float32"))


def _instantiate_fixed(config: dict[str, Any], plain: Any, seed: int) -> Any:
    from .weights import instantiate

    model = instantiate(config, seed)
    plain.fix_init(model)
    return model


def _cross_encoder(path: Path, seed: int) -> None:
    import mlx.core as mx
    from mlx_vlm.models import bert
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from .tokenizer import TokenizerSpec, train_bpe
    from .weights import weight_tensors

    specials = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
    spec = TokenizerSpec(768, specials, {}, {}, "")
    backend = train_bpe(spec)
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                        model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    tokenizer.model_max_length = 512
    tokenizer.save_pretrained(str(path))
    config = {"model_type": "bert", "architectures": ["BertForSequenceClassification"], "vocab_size": 768,
              "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
              "max_position_embeddings": 512, "type_vocab_size": 2, "num_labels": 1, "id2label": {"0": "LABEL_0"},
              "hidden_act": "gelu", "layer_norm_eps": 1e-12, "pad_token_id": 0}
    mx.random.seed(seed)
    model = bert.SequenceClassificationModel(bert.ModelConfig.from_dict(config))
    _save(path, config, weight_tensors(model, "float32"))
