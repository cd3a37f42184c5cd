"""[main] The ``vlmserve`` command: caption one image, serve, build offline models, train the demo."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import queue
import sys
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmserve.config import (
    DTYPES,
    CaptionConfig,
    EngineConfig,
    ServeConfig,
    SpeculativeConfig,
    field_default,
    param_default,
    resolve_drafter,
    resolve_model,
    usage_error,
)
from vlmserve.testing.build import ARCHS, SIZES, build_model
from vlmserve.tools.registry import ALIASES, PARSERS

TOOL_PARSERS = (*PARSERS, *ALIASES)
DTYPE_HELP = ("float weights as served: auto (float32 on a Linux CPU with OpenBLAS, where it is fastest; "
              "else as stored), model (as stored) or one dtype")



def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if argv is None and getattr(args, "wants_openblas", False):
        from vlmserve.blas import reexec_with_openblas

        reexec_with_openblas(sys.argv[1:])  # returns only when it does not restart
    serving = args.func is _serve_command
    args.log_level = args.log_level or (field_default(ServeConfig, "log_level") if serving else LOG_LEVEL)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format=LOG_FORMAT)
    return int(args.func(args))


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_LEVEL = "warning"  # every command's but serve's, whose is ServeConfig.log_level


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless the text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS  # not 0
        if "default" in text or unset or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def _parser() -> argparse.ArgumentParser:
    from vlmserve import __version__

    parser = argparse.ArgumentParser(prog="vlmserve", description="Serve vision-language models on MLX.",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"vlmserve {__version__}")
    parser.add_argument("--log-level", default=None, choices=LOG_LEVELS,
                        help=f"log verbosity (default: {field_default(ServeConfig, 'log_level')} for serve, "
                             f"{LOG_LEVEL} otherwise)")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    cap = sub.add_parser("caption", help="caption one image and print the text as it is generated")
    cap.add_argument("image", type=Path, help="an image file (PNG, JPEG, WebP...)")
    cap.add_argument("--model", default=None, help="local directory or Hub id (default: the built-in demo model)")
    cap.add_argument("--prompt", default=field_default(CaptionConfig, "prompt"), help="the instruction sent with the image")
    cap.add_argument("--max-tokens", type=int, default=field_default(CaptionConfig, "max_tokens"),
                     help="most tokens to generate")
    cap.add_argument("--temperature", type=float, default=field_default(CaptionConfig, "temperature"), help="0 is greedy")
    cap.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    cap.add_argument("--dtype", default=field_default(CaptionConfig, "dtype"), choices=DTYPES, help=DTYPE_HELP)
    cap.set_defaults(func=_caption_command, wants_openblas=True)

    _serve_parser(sub.add_parser("serve", help="serve an OpenAI-compatible API"))

    build = sub.add_parser("build-model", help="build a small offline model (random weights) in HF layout")
    build.add_argument("--arch", default=param_default(build_model, "arch"), choices=ARCHS, help="an mlx-vlm model_type")
    build.add_argument("--size", default=param_default(build_model, "size"), choices=SIZES, help="the model's size")
    build.add_argument("--out", type=Path, default=None, help="directory (default: the shared model cache)")
    build.add_argument("--seed", type=int, default=param_default(build_model, "seed"), help="random weights' seed")
    build.add_argument("--ignore-eos", action="store_true", help="the model never emits EOS (benchmarks)")
    build.add_argument("--quant-bits", type=int, default=param_default(build_model, "quant_bits"), choices=(0, 4, 8),
                       help="quantize as mlx_vlm.convert -q (0: no)")
    build.add_argument("--tools", action="store_true", help="tune it to answer one tool round trip")
    build.add_argument("--force", action="store_true", help="rebuild even when the model exists")
    build.set_defaults(func=_build_command)

    from vlmserve.testing.demo.commands import add_cli  # its own module: the package needs not import it

    add_cli(sub)  # train-demo, eval-demo
    for command in sub.choices.values():  # the same formatter, and --log-level after the command too
        command.formatter_class = _HelpFormatter
        command.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS, help="log verbosity")
    return parser


def _serve_parser(srv: argparse.ArgumentParser) -> None:
    serve, engine = ServeConfig(), EngineConfig()  # every default below is read from these
    _models_options(srv.add_argument_group("the models served, and how"), serve, engine)
    _media_options(srv.add_argument_group("images and videos in requests"), serve, engine)
    _http_options(srv.add_argument_group("the HTTP server"), serve, engine)
    _batching_options(srv.add_argument_group("batching and scheduling"), serve, engine)
    _caches_options(srv.add_argument_group("KV and caches"), serve, engine)
    _speculative_options(srv.add_argument_group("speculative decoding"), serve, engine)
    srv.set_defaults(func=_serve_command, wants_openblas=True)


def _models_options(group: Any, serve: ServeConfig, engine: EngineConfig) -> None:
    group.add_argument("--model", action="append", default=[],
                       help="local directory or Hub id; repeat to serve several (default: the built-in demo model)")
    group.add_argument("--served-model-name", action="append", nargs="+", default=[], metavar="NAME",
                       help="the names a model answers to, the first shown in /v1/models (default: the --model "
                            "string and a directory's base name); repeat once per --model, in order")
    group.add_argument("--model-dir", action="append", type=Path, default=[], metavar="DIR",
                       help="serve every model folder under DIR on demand, named by its folder (DIR/name, or "
                            "DIR/org/name): listed at once, loaded on its first request, unloaded when idle or to make "
                            "room; repeatable. With it and no --model, only these are served")
    group.add_argument("--max-loaded-models", type=int, default=serve.max_loaded_models, metavar="N",
                       help="models loaded at once, --model ones included; a load unloads the least recently used "
                            "idle model of --model-dir first (default: no limit)")
    group.add_argument("--memory-budget-gb", type=float, default=serve.memory_budget_gb, metavar="G",
                       help="the loaded models' weights and KV reservations at most; a load unloads the least recently "
                            "used idle models of --model-dir until it fits (default: no limit)")
    group.add_argument("--idle-unload-s", type=float, default=serve.idle_unload_s, metavar="S",
                       help=f"unload a model of --model-dir nobody has used for S seconds; 0: never (default: "
                            f"{serve.idle_unload_s:g})")
    group.add_argument("--task", default=engine.task, choices=["auto", "generate", "embed", "score"],
                       help="what every --model serves: generate (chat), embed (/v1/embeddings) or score "
                            "(/v1/rerank), as vLLM's --task; auto: read from each model's files (default: auto)")
    group.add_argument("--runner", default=None, choices=["auto", "generate", "pooling"],
                       help="vLLM's newer spelling: pooling serves every --model as an embedding model or, where its "
                            "files say so, a reranker")
    group.add_argument("--dtype", default=engine.dtype, choices=DTYPES, help=DTYPE_HELP)
    group.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                       help="a Jinja chat template (a file, or the template itself) that replaces every model's own")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="let transformers run a model repository's own processor code (as vLLM's flag)")
    group.add_argument("--tool-parser", default=None, choices=TOOL_PARSERS,
                       help="the tool-call format (default: the chat template's, else the model family's)")
    group.add_argument("--default-chat-template-kwargs", type=_json_object, default={}, metavar="JSON",
                       help="chat-template variables for every request, e.g. '{\"enable_thinking\": false}' (a "
                            "request's chat_template_kwargs win)")
    group.add_argument("--default-max-tokens", type=int, default=serve.default_max_tokens,
                       help="max_tokens when a request gives none")
    group.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens (default: the model's)")


def _media_options(group: Any, serve: ServeConfig, engine: EngineConfig) -> None:
    group.add_argument("--limit-mm-per-prompt", type=_json_object,
                       default={"image": serve.max_images, "video": serve.max_videos, "audio": serve.max_audio},
                       metavar="JSON", help=f'media items in one request, as vLLM takes it: \'{{"image": '
                                            f'{serve.max_images}, "video": {serve.max_videos}, "audio": {serve.max_audio}}}\'')
    group.add_argument("--video-fps", type=float, default=serve.video_fps,
                       help="frames sampled per second of a video (a request's mm_processor_kwargs fps wins)")
    group.add_argument("--video-max-frames", type=int, default=serve.video_max_frames,
                       help="frames sampled from one video at most (a request may ask for fewer)")
    group.add_argument("--allowed-media-dir", action="append", type=Path, default=[], help="local images may come from here")
    group.add_argument("--allow-remote-images", action="store_true", help="fetch http(s) image URLs (public addresses only)")
    group.add_argument("--allowed-media-domains", nargs="+", action="extend", default=[], metavar="DOMAIN",
                       help="with --allow-remote-images: only these hosts (and their subdomains), which may then be private")
    group.add_argument("--max-image-pixels", type=_pixels, default=serve.max_image_pixels, metavar="PIXELS",
                       help="larger images are refused (400) from their header, before any decoding (5e7: 50 MP)")
    group.add_argument("--decode-pixels", type=_pixels, default=serve.decode_pixels, metavar="PIXELS",
                       help="image pixels being decoded at once, server-wide (each image is then shrunk to what its "
                            "model's processor uses); later images wait their turn")


def _http_options(group: Any, serve: ServeConfig, engine: EngineConfig) -> None:
    group.add_argument("--host", default=serve.host, help="address to listen on")
    group.add_argument("--port", type=int, default=serve.port, help="port to listen on")
    group.add_argument("--api-key", default=os.environ.get("VLMSERVE_API_KEY") or None,
                       help="require Authorization: Bearer KEY (default: $VLMSERVE_API_KEY, else no key)")
    group.add_argument("--cors-origin", action="append", default=[],
                       help="allow browser requests from this origin, e.g. http://localhost:3000; repeat for several "
                            "or * for any (default: none)")
    group.add_argument("--max-request-mb", type=float, default=serve.max_request_bytes / 2**20,
                       help="larger request bodies get 413")
    group.add_argument("--header-timeout", type=float, default=serve.header_timeout_s,
                       help="seconds a new connection has to send its request's headers before it is closed")
    group.add_argument("--keep-alive-timeout", type=float, default=serve.keep_alive_timeout_s,
                       help="seconds an idle kept-alive connection stays open")
    group.add_argument("--shutdown-timeout", type=float, default=serve.shutdown_timeout,
                       help="seconds running requests get to finish after SIGTERM before they end with an error")
    group.add_argument("--stream-stall-timeout", type=float, default=engine.stall_timeout_s,
                       help="seconds a client may read nothing while tokens wait before its request is aborted")
    group.add_argument("--ssl-keyfile", type=Path, default=None, help="with --ssl-certfile: serve HTTPS")
    group.add_argument("--ssl-certfile", type=Path, default=None, help="the certificate (chain) for --ssl-keyfile")


def _batching_options(group: Any, serve: ServeConfig, engine: EngineConfig) -> None:
    group.add_argument("--max-batch-size", type=int, default=engine.max_batch_size,
                       help="requests decoded together at most; the KV budget (--kv-cache-gb) bounds the batch below it")
    group.add_argument("--max-num-seqs", type=int, dest="max_batch_size", default=argparse.SUPPRESS,
                       help="vLLM's name for --max-batch-size")
    group.add_argument("--max-queue", type=int, default=engine.max_queue, help="waiting requests beyond the batch before 429")
    group.add_argument("--prefill-chunk", type=int, default=engine.prefill_chunk,
                       help="prompt tokens per step while nothing decodes (a prompt split by layers: its share of them)")
    group.add_argument("--stream-prefill-chunk", type=int, default=engine.stream_prefill_chunk,
                       help="prompt tokens per step while requests decode (default: sized from the measured cost of a "
                            "prompt token and a decode step, see --stream-step-share)")
    group.add_argument("--stream-step-share", type=float, default=engine.stream_step_share,
                       help="while requests decode, the prompt and vision work of a step may take this many decode "
                            "steps' time: higher starts new requests sooner, lower keeps running streams smoother")
    group.add_argument("--no-join-gate", dest="join_gate", action="store_false",
                       help="a prompt that ends while others are in their prompts joins the decode batch at once "
                            "(by default its row waits, its first token sent, until they end)")
    group.add_argument("--stream-step-share-max", type=float, default=engine.stream_step_share_max,
                       help="the share grows with how long the oldest prompt has waited, up to this many decode "
                            "steps' time: no step with prompt work takes longer than about this plus one")
    group.add_argument("--encoder-budget", type=int, default=engine.encoder_budget,
                       help="images through the vision tower per step while requests decode")
    group.add_argument("--pipeline-timeout", type=float, default=engine.pipeline_timeout_s,
                       help="launched by mlx.launch on several ranks: seconds rank 0 waits on the others in a step or "
                            "heartbeat before it declares one hung, ends every request and stops")


def _caches_options(group: Any, serve: ServeConfig, engine: EngineConfig) -> None:
    group.add_argument("--kv-cache-gb", type=float, default=None,
                       help="KV-cache memory for running requests; a request that could never fit gets 400, others "
                            "wait (default: 80%% of Metal's recommended working set, else half the RAM, less the weights)")
    group.add_argument("--kv-bits", type=int, choices=(4, 8), default=engine.kv_bits,
                       help="quantize the KV cache (running requests' and the prefix caches') to this many bits a value, "
                            "so more context fits in --kv-cache-gb; sliding-window and recurrent layers stay in full "
                            "precision, and families that cannot read a packed cache say so at start-up")
    group.add_argument("--kv-group-size", type=int, default=engine.kv_group_size,
                       help="values per quantization scale and bias (with --kv-bits; must divide the model's head size)")
    group.add_argument("--quantized-kv-start", type=int, default=engine.quantized_kv_start,
                       help="positions a layer's cache holds before it is quantized (with --kv-bits): 0 quantizes every "
                            "prompt after its first forward, as mlx-lm does past the start")
    group.add_argument("--prefix-cache-dir", type=Path, default=None,
                       help="a directory where the prefix caches spill what they evict (and hold at shutdown), read back "
                            "when a prompt matches and across restarts; one directory per server (it is locked)")
    group.add_argument("--prefix-cache-disk-gb", type=float, default=engine.prefix_cache_disk_bytes / 2**30,
                       help="the most --prefix-cache-dir holds (least recently used files go first)")
    group.add_argument("--vision-cache-mb", type=float, default=engine.vision_cache_bytes / 2**20,
                       help="image features kept across requests, so an image shown again skips the vision tower; 0 turns "
                            "it off")
    group.add_argument("--mm-prefix-cache", action="store_true", default=engine.mm_prefix_cache,
                       help="let prompts with images reuse a cached prefix (a conversation's earlier turns), keyed by "
                            "every image's content; only on families where it is exact (Qwen2/2.5/3-VL, Gemma 3/4, "
                            "LLaVA), a no-op said at start-up elsewhere")
    group.add_argument("--mm-prefix-cache-gb", type=float, default=engine.mm_prefix_cache_bytes / 2**30,
                       help="the image prefix cache's memory (least recently used entries go first)")
    group.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache for text prompts off")
    group.add_argument("--prefix-cache-entries", type=int, default=engine.prefix_cache_entries,
                       help="prompts each prefix cache keeps: the least recently stored go first, one sent with a "
                            "cache_control breakpoint only after all others until its TTL ends")
    group.add_argument("--prefix-cache-gb", type=float, default=engine.prefix_cache_bytes / 2**30,
                       help="the text prefix cache's memory (within the KV budget: running requests come first)")


def _speculative_options(group: Any, serve: ServeConfig, engine: EngineConfig) -> None:
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, as vLLM spells it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\', or a drafter: \'{"method": "mtp", "model": '
                            'DIR, "num_speculative_tokens": 3}\' (no "model": a Qwen3.5 checkpoint\'s own MTP layers); drafts '
                            'are verified, so the output is the same, sooner '
                            "where drafts are right (a request's OpenAI prediction is a draft on any server)")
    group.add_argument("--draft-model", default=None, metavar="PATH",
                       help='a drafter model, as mlx_vlm.server spells it: the same as \'{"method": KIND, "model": PATH}\'')
    group.add_argument("--draft-kind", default=None, metavar="KIND",
                       help="the --draft-model's kind: mtp (Gemma 4 assistant and Qwen3.5 MTP drafters), dflash (DFlash "
                            "drafters for Qwen3.5 and Gemma 4), eagle3 (EAGLE-3 drafters for Gemma 4) or draft_model "
                            "(a small text model of the model's tokenizer); others are refused at start-up")
    group.add_argument("--draft-block-size", type=int, default=None, metavar="N",
                       help="with --draft-model: tokens per verify, the input's included (num_speculative_tokens + 1)")


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object from the command line."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _pixels(text: str) -> int:
    """A pixel count, whole or in exponent form (5e7)."""
    return int(float(text))


def _speculative(args: argparse.Namespace) -> SpeculativeConfig | None | str:
    """``--speculative-config`` (or mlx_vlm.server's ``--draft-model``/``--draft-kind``), or what is wrong."""
    if args.draft_model is not None or args.draft_kind is not None or args.draft_block_size is not None:
        if args.speculative_config is not None:
            return "--draft-model and --speculative-config say the same thing: give one of them"
        if args.draft_model is None:
            return "--draft-kind and --draft-block-size need --draft-model"
        try:
            return SpeculativeConfig(method=args.draft_kind or "mtp", model=resolve_drafter(args.draft_model),
                                     num_speculative_tokens=(args.draft_block_size or 4) - 1)
        except ValueError as exc:
            return f"--draft-model: {exc}"
    if args.speculative_config is None:
        return None
    try:
        config = SpeculativeConfig.parse(args.speculative_config)
    except (TypeError, ValueError) as exc:
        return f"--speculative-config: {exc}"
    return dataclasses.replace(config, model=resolve_drafter(config.model)) if config.model else config


def serve_config(args: argparse.Namespace) -> ServeConfig | str:
    """The parsed ``serve`` command line as a config, or what is wrong with it."""
    problem = _bounds(args) or _files(args) or _model_dirs(args)
    if problem is not None:
        return problem
    template, problem = _chat_template(args)
    if problem is not None:
        return problem
    speculative = _speculative(args)
    if isinstance(speculative, str):
        return speculative
    engine = _engine_config(args, template, speculative)
    return ServeConfig(
        models=tuple(args.model), host=args.host, port=args.port, api_key=args.api_key,
        allowed_media_dirs=tuple(args.allowed_media_dir), allow_remote_images=args.allow_remote_images,
        allowed_media_domains=tuple(d.lower().rstrip(".") for d in args.allowed_media_domains),
        tool_parser=args.tool_parser, default_max_tokens=args.default_max_tokens,
        max_request_bytes=int(args.max_request_mb * 2**20),
        log_level=args.log_level or field_default(ServeConfig, "log_level"),
        shutdown_timeout=args.shutdown_timeout, cors_origins=tuple(args.cors_origin), engine=engine,
        header_timeout_s=args.header_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
        max_image_pixels=args.max_image_pixels, decode_pixels=args.decode_pixels,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        served_names=tuple(tuple(names) for names in args.served_model_name),
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        max_images=args.limit_mm_per_prompt.get("image", field_default(ServeConfig, "max_images")),
        max_videos=args.limit_mm_per_prompt.get("video", field_default(ServeConfig, "max_videos")),
        max_audio=args.limit_mm_per_prompt.get("audio", field_default(ServeConfig, "max_audio")),
        video_fps=args.video_fps, video_max_frames=args.video_max_frames,
        model_dirs=tuple(args.model_dir), max_loaded_models=args.max_loaded_models,
        memory_budget_gb=args.memory_budget_gb, idle_unload_s=args.idle_unload_s,
    )


def _bounds(args: argparse.Namespace) -> str | None:
    """What is out of range among the numbers, if anything."""
    positive = (args.prefill_chunk, args.encoder_budget, args.stream_prefill_chunk or 1)
    if args.max_batch_size < 1 or args.max_queue < 0 or min(positive) < 1 or args.stream_step_share <= 0:
        return ("--max-batch-size, --prefill-chunk, --stream-prefill-chunk and --encoder-budget must be >= 1, "
                "--max-queue >= 0 and --stream-step-share > 0")
    if args.pipeline_timeout <= 0:
        return "--pipeline-timeout must be > 0"
    if args.shutdown_timeout < 0 or min(args.stream_stall_timeout, args.kv_cache_gb or 1, args.header_timeout,
                                        args.keep_alive_timeout) <= 0:
        return ("--shutdown-timeout must be >= 0; --stream-stall-timeout, --kv-cache-gb, --header-timeout and "
                "--keep-alive-timeout > 0")
    if min(args.vision_cache_mb, args.mm_prefix_cache_gb, args.prefix_cache_gb) < 0 or args.prefix_cache_disk_gb <= 0:
        return ("--vision-cache-mb, --mm-prefix-cache-gb and --prefix-cache-gb must be >= 0, --prefix-cache-disk-gb > 0")
    if args.prefix_cache_entries < 1:
        return "--prefix-cache-entries must be >= 1 (--no-prefix-cache turns the text prefix cache off)"
    if args.kv_group_size not in (32, 64, 128) or args.quantized_kv_start < 0:
        return "--kv-group-size must be 32, 64 or 128 and --quantized-kv-start >= 0"
    limits = args.limit_mm_per_prompt
    if set(limits) - {"image", "video", "audio"} or not all(isinstance(n, int) and n >= 0 for n in limits.values()):
        return '--limit-mm-per-prompt: a JSON object of "image", "video" and "audio" counts >= 0, e.g. \'{"image": 4}\''
    if not 0 < args.video_fps <= 60 or args.video_max_frames < 2:
        return "--video-fps must be in (0, 60] and --video-max-frames >= 2"
    if len(args.served_model_name) > max(1, len(args.model)):
        return "--served-model-name: give it once per --model, in the same order"
    if min(args.max_image_pixels, args.decode_pixels) < 1:
        return "--max-image-pixels and --decode-pixels must be >= 1"
    return None


def _files(args: argparse.Namespace) -> str | None:
    """A file or directory the command line names that is not there, if any."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        return "--ssl-keyfile and --ssl-certfile go together"
    for tls in (args.ssl_keyfile, args.ssl_certfile):
        if tls is not None and not tls.is_file():
            return f"{tls}: no such file"
    for directory in args.allowed_media_dir:
        if not directory.is_dir():
            return f"--allowed-media-dir {directory}: not a directory"
    return None


def _chat_template(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """--chat-template's text (a file's, or itself), or what is wrong with it."""
    given: str | None = args.chat_template
    if given is None or "{" in given:  # a template itself: it always has a {{ or {% in it
        return given, None
    try:
        return Path(given).expanduser().read_text(), None
    except OSError as exc:
        return None, f"--chat-template {given}: {exc.strerror or exc}"


def _engine_config(args: argparse.Namespace, template: str | None, speculative: SpeculativeConfig | None) -> EngineConfig:
    """The engine's part of the ``serve`` command line (checked already)."""
    return EngineConfig(
        max_batch_size=args.max_batch_size, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
        stream_prefill_chunk=args.stream_prefill_chunk, stream_step_share=args.stream_step_share,
        stream_step_share_max=args.stream_step_share_max, join_gate=args.join_gate,
        encoder_budget=args.encoder_budget, max_model_len=args.max_model_len, prefix_cache=not args.no_prefix_cache,
        prefix_cache_entries=args.prefix_cache_entries, prefix_cache_bytes=int(args.prefix_cache_gb * 2**30),
        dtype=args.dtype, trust_remote_code=args.trust_remote_code, chat_template=template,
        kv_cache_bytes=int(args.kv_cache_gb * 2**30) if args.kv_cache_gb else None,
        vision_cache_bytes=int(args.vision_cache_mb * 2**20), stall_timeout_s=args.stream_stall_timeout,
        mm_prefix_cache=args.mm_prefix_cache, mm_prefix_cache_bytes=int(args.mm_prefix_cache_gb * 2**30),
        pipeline_timeout_s=args.pipeline_timeout, speculative=speculative, kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size, quantized_kv_start=args.quantized_kv_start,
        prefix_cache_dir=str(args.prefix_cache_dir) if args.prefix_cache_dir else None,
        prefix_cache_disk_bytes=int(args.prefix_cache_disk_gb * 2**30),
        task="pooling" if args.runner == "pooling" else args.task if args.runner in (None, "auto") else args.runner,
    )


def _model_dirs(args: argparse.Namespace) -> str | None:
    """What is wrong with --model-dir and its limits, if anything."""
    for directory in args.model_dir:
        if not directory.is_dir():
            return f"--model-dir {directory}: not a directory"
    if args.max_loaded_models is not None and args.max_loaded_models < 1:
        return "--max-loaded-models must be >= 1"
    if args.model_dir and args.max_loaded_models is not None and args.max_loaded_models <= len(args.model):
        return (f"--max-loaded-models {args.max_loaded_models} leaves no room for a model of --model-dir beside "
                f"{len(args.model)} --model(s), which never unload")
    if args.memory_budget_gb is not None and args.memory_budget_gb <= 0:
        return "--memory-budget-gb must be > 0"
    if args.idle_unload_s < 0:
        return "--idle-unload-s must be >= 0 (0: never)"
    return None


def _serve_command(args: argparse.Namespace) -> int:
    from vlmserve.server import serve, serve_rank

    config = serve_config(args)
    if isinstance(config, str):
        return usage_error(config)
    if "MLX_RANK" in os.environ:  # one rank of an mlx.launch group (engine/pipeline.py)
        return serve_rank(config)
    return serve(config)


def _build_command(args: argparse.Namespace) -> int:
    try:
        path = build_model(args.arch, args.size, out=args.out, seed=args.seed, ignore_eos=args.ignore_eos,
                           quant_bits=args.quant_bits, tools=args.tools, force=args.force)
    except ValueError as exc:
        return usage_error(str(exc))
    print(path)
    return 0


def _caption_command(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        return usage_error("--max-tokens must be at least 1")
    if args.temperature < 0:
        return usage_error("--temperature must be >= 0")
    config = CaptionConfig(args.image, args.model, args.prompt, args.max_tokens, args.temperature, args.seed, args.dtype)
    return caption(config)


# -- caption ----------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class _Done:
    """The worker's last message to the printing thread."""

    error: BaseException | None = None


def caption(config: CaptionConfig) -> int:
    """Decode the image, load the model on a worker thread (as the server does: engine/assembly.py), stream
    the caption to stdout."""
    from vlmserve.engine.assembly import load_for_serving
    from vlmserve.engine.engine_config import EngineConfig
    from vlmserve.engine.loader import ModelLoadError
    from vlmserve.engine.worker import MLXWorkerThread
    from vlmserve.preprocess.images import ImageError, load_image_file

    try:
        image = load_image_file(config.image)
    except ImageError as exc:
        return usage_error(str(exc))
    try:
        model_path, name = resolve_model(config.model)
    except FileNotFoundError as exc:
        return usage_error(str(exc))
    worker = MLXWorkerThread(name="mlx-caption")
    worker.start()
    try:
        engine = EngineConfig(dtype=config.dtype, preprocess_threads=1)
        assembled = _wait_with_spinner(worker.submit(load_for_serving, model_path, name, engine), f"loading {name}")
        return _stream_caption(worker, assembled.loaded, assembled.prompt_builder(engine), image, config)
    except ModelLoadError as exc:
        return usage_error(str(exc))
    finally:
        worker.shutdown()


def _stream_caption(worker: Any, loaded: Any, prompter: Any, image: Any, config: CaptionConfig) -> int:
    from vlmserve.engine.params import SamplingParams
    from vlmserve.frontend.detokenizer import IncrementalDetokenizer

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": config.prompt}]}]
    prompt = prompter.build(messages, [image])
    params = SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, seed=config.seed)
    tokens: queue.SimpleQueue[int | _Done] = queue.SimpleQueue()
    worker.submit(_generate_into, worker, loaded, prompt, params, tokens)
    detok = IncrementalDetokenizer(loaded.tokenizer)
    while not isinstance(item := tokens.get(), _Done):
        sys.stdout.write(detok.add(item))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    if item.error is not None:
        raise item.error
    return 0


def _generate_into(worker: Any, loaded: Any, prompt: Any, params: Any, out: queue.SimpleQueue[Any]) -> None:
    from vlmserve.engine.generate import generate_tokens
    from vlmserve.engine.runner import ModelRunner

    worker.assert_on_worker()
    try:
        for token in generate_tokens(ModelRunner(loaded), prompt, params):
            out.put(token)
    except Exception as exc:  # noqa: BLE001 - re-raised on the main thread
        out.put(_Done(exc))
    else:
        out.put(_Done())


def _wait_with_spinner(future: Future[Any], label: str) -> Any:
    from vlmserve.progress import progress

    with progress(desc=label, file=sys.stderr, bar_format="{desc} {elapsed}", leave=False) as bar:
        while True:
            try:
                return future.result(timeout=0.1)
            except TimeoutError:
                bar.refresh()  # redraws the elapsed time; off a terminal, a line now and then


if __name__ == "__main__":
    sys.exit(main())
