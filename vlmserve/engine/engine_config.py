"""[any] How one model's engine runs: batch and queue sizes, caches, memory, timeouts. No MLX here."""

from __future__ import annotations

from dataclasses import dataclass

from vlmserve.engine.speculative import SpeculativeConfig

# How float weights are served: auto (float32 on a Linux CPU with OpenBLAS, else as stored),
# model (as stored), or one dtype. See vlmserve.engine.loader.serving_dtype.
DTYPES = ("auto", "model", "float32", "bfloat16", "float16")
DEFAULT_DTYPE = "auto"


@dataclass(slots=True, frozen=True)
class EngineConfig:
    # Rows decoded together at most, as vLLM's --max-num-seqs: the KV budget (engine/memory.py) is what bounds a
    # batch; this is an explicit cap on top of it
    max_batch_size: int = 256
    max_queue: int = 64  # requests waiting beyond the batch before submissions fail fast
    preprocess_threads: int = 4  # phase 1's pool (chat template, tokenizer), shared by a server's models
    image_threads: int = 2  # phase 1's image lane: requests with images, decoded and preprocessed apart from text
    prefill_chunk: int = 512  # prompt tokens per step (a prompt split by layers: its share of them)
    # While requests decode, a step's prompt work may take this many decode steps' time (engine/costs.py):
    stream_step_share: float = 2.0
    # ...and more, the longer the oldest prompt has waited, up to this many (the backlog's deadline): a step is then
    # at most 1 + 5 decode steps long (where the floor binds, it grows by as much). Most of a burst's steps carry prompt
    # work, so a running row's longest gap stayed within 2.3-3.5x its median over a burst of 8 images (issue 60,
    # stall_bench.py), and each burst step a prompt shares with a decode forward is one fewer: against 3, the last
    # image's answer came 0.2-0.7 s sooner on the small models (1.32x -> 1.11x and 1.12x -> 1.06x of mlx_vlm.server's)
    stream_step_share_max: float = 5.0
    # A prompt that ends while others are in their prompts keeps its row out of the decode batch until they
    # end (its first token goes out at once): engine/scheduler.py's join gate
    join_gate: bool = True
    stream_prefill_chunk: int | None = None  # or a fixed prompt-token budget per step while requests decode
    encoder_budget: int = 1  # images through the vision tower per step while requests decode (the first always goes)
    max_model_len: int | None = None  # caps the model's own context (prompt + output)
    prefix_cache: bool = True
    prefix_cache_entries: int = 32
    prefix_cache_bytes: int = 1 << 30
    # Prompts with images reuse a cached prefix only with this on, keyed by their images' content too,
    # and only on families where that is exact (engine/caches.py); its own store, bounded in bytes:
    mm_prefix_cache: bool = False
    mm_prefix_cache_bytes: int = 1 << 30
    # The prefix stores' disk tier (engine/disk_tier.py): where what they evict, and hold at shutdown, is kept
    # across restarts (None: nowhere), and the most it holds
    prefix_cache_dir: str | None = None
    prefix_cache_disk_bytes: int = 16 << 30
    dtype: str = DEFAULT_DTYPE  # the float weights' dtype when served (loader.serving_dtype)
    trust_remote_code: bool = False  # passed to mlx-vlm's loader (a processor with its own code)
    chat_template: str | None = None  # a Jinja chat template that replaces the model's own
    kv_cache_bytes: int | None = None  # the KV budget; None: sized from the machine's memory (engine/memory.py)
    # Quantized KV (engine/kv_quant.py): bits per value (4 or 8; None: full precision), values per scale and
    # bias, and the positions a layer holds before it is packed (0: from its first forward; mlx-lm's 5000
    # would leave every short prompt in full precision, and the budget could not count on the saving)
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    vision_cache_bytes: int = 256 << 20  # image features kept across requests; 0: off (engine/vision_cache.py)
    # Serve across the ranks of an ``mlx.launch`` group (engine/pipeline.py): set by ``vlmserve serve`` on rank 0.
    pipeline: bool = False
    # Rank 0 declares another rank hung when a step or heartbeat (every min(2 s, a quarter of this)) waits this long:
    pipeline_timeout_s: float = 30.0
    # Speculative decoding with ngram drafts (engine/speculative.py); None: only requests' predictions are drafts
    speculative: SpeculativeConfig | None = None
    stall_timeout_s: float = 30.0  # a consumer that takes no output for this long, with outputs waiting, is aborted
    # What a model serves: generate (chat), embed or score (rerank); auto: read from its files (engine/pooling.py)
    task: str = "auto"
