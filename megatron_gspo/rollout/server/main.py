"""`megatron-gspo serve`: arguments, the model and the aiohttp app of the embedded rollout server.

megatron-gspo serve --model DIR --port 30000
python -m megatron_gspo.rollout.server --model DIR --port 30000
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import gc
import logging
import os
import signal
import sys

import torch

from megatron_gspo.rollout.server import http_app
from megatron_gspo.rollout.server.decode_aids import DecodeAids
from megatron_gspo.rollout.server.engine import GenerationEngine
from megatron_gspo.rollout.server.scheduler import BatchScheduler
from megatron_gspo.rollout.server.service import GENERATION_PATHS, GET_ROUTES, POST_ROUTES, RolloutService

logger = logging.getLogger(__name__)

DECODE_DELAY_ENV = "MEGATRON_GSPO_SERVE_DECODE_DELAY_MS"
"""The default of `--decode-delay-ms`: reaches the servers a training run starts (tests only)."""
HOLD_DECODE_ENV = "MEGATRON_GSPO_SERVE_HOLD_DECODE_AFTER_RESPONSES"
"""The default of `--hold-decode-after-responses`: reaches the servers a training run starts (tests only)."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of `megatron-gspo serve` (and `python -m megatron_gspo.rollout.server`)."""
    parser.add_argument(
        "--model",
        required=True,
        help="HF checkpoint directory (safetensors + config + tokenizer), training checkpoint "
        "(RUN/checkpoints/step_N, exported to a temporary HF directory first) or run directory (its newest "
        "intact checkpoint)",
    )
    parser.add_argument("--port", type=int, default=30000, help="TCP port (0 picks a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="model dtype")
    parser.add_argument(
        "--return-original-logprob",
        action="store_true",
        help="report log_softmax of the raw logits, as SGLANG_RETURN_ORIGINAL_LOGPROB=1 does "
        "(default: log_softmax(logits / temperature))",
    )
    parser.add_argument("--weight-version", default="default", help="initial weight_version")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generators of unseeded requests")
    parser.add_argument("--max-batch-size", type=int, default=256, help="rows per generation batch")
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        default=5.0,
        help="how long to collect concurrent requests into one batch",
    )
    parser.add_argument(
        "--check-responses",
        action="store_true",
        help="check every response against SGLang's contract (debug/tests)",
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=1024.0,
        help="largest request body in MiB, else 413 (a /update_weights_from_tensor payload is "
        "4/3 of the tensors' bytes)",
    )
    parser.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="report this SGLang dp_size and, above 1, refuse the weight updates SGLang refuses at "
        "dp_size > 1 (/init_weights_update_group, /update_weights_from_tensor); generation is "
        "one replica either way, as one SGLang URL is to its client (tests of DP deployments)",
    )
    parser.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="report this SGLang tp_size and, as SGLang's TP ranks do, open one "
        "/update_weights_from_tensor entry per rank (each its own); computes as one rank either way "
        "(a colocated run's server spanning tp-size devices); above 1 a distributed weight-update "
        "group is refused (one process cannot join as several ranks)",
    )
    parser.add_argument(
        "--base-gpu-id",
        type=int,
        default=0,
        help="report this SGLang base_gpu_id: the first of the node's devices the server's TP ranks "
        "sit on (a colocated run's weight sync hands each rank the memory of the trainer on its device)",
    )
    parser.add_argument(
        "--weight-update-timeout-s",
        type=float,
        default=1800.0,
        help="timeout of the weight-update groups this server joins, so of a broadcast it waits in "
        "(SGLang's: torch's default process-group timeout, 30 min, not settable over HTTP)",
    )
    parser.add_argument(
        "--decode-delay-ms",
        type=float,
        default=float(os.environ.get(DECODE_DELAY_ENV, 0.0)),
        help=f"test aid: wait this long before each decode step, so that generation is slow enough "
        f"for a weight sync to land mid-response (default: ${DECODE_DELAY_ENV}, else 0: off)",
    )
    parser.add_argument(
        "--hold-decode-after-responses",
        type=int,
        default=int(os.environ.get(HOLD_DECODE_ENV, 0)),
        help="test aid: once this many responses (its own /health generations too) have ended "
        "under the weights served, a batch decodes one token and waits for a pause or its abort, "
        f"so the next sync that pauses lands mid-response (default: ${HOLD_DECODE_ENV}, else 0: off)",
    )
    parser.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="allow /release_memory_occupation and /resume_memory_occupation (SGLang's flag; "
        "without it they are refused)",
    )
    parser.add_argument(
        "--kv-pool-mb",
        type=float,
        default=0.0,
        help="MiB reserved at start for the KV cache pool SGLang preallocates (released and resumed "
        "with tag kv_cache); batches keep their own caches, so 0 (default) reserves nothing",
    )
    parser.add_argument("--log-level", default="warning", help="python logging level")
    return parser


def build_service(args: argparse.Namespace) -> RolloutService:
    """Load the model and start the batcher."""
    engine = GenerationEngine(
        args.model,
        dtype=_DTYPES[args.dtype],
        return_original_logprob=args.return_original_logprob,
        weight_version=args.weight_version,
        seed=args.seed,
        aids=DecodeAids.from_flags(args.decode_delay_ms / 1000, args.hold_decode_after_responses),
        enable_memory_saver=args.enable_memory_saver,
        kv_pool_bytes=int(args.kv_pool_mb * 2**20),
    )
    scheduler = BatchScheduler(
        engine, batch_window_s=args.batch_window_ms / 1000, max_batch_size=args.max_batch_size
    )
    return RolloutService(
        engine,
        scheduler,
        check_responses=args.check_responses,
        dp_size=args.dp_size,
        tp_size=args.tp_size,
        base_gpu_id=args.base_gpu_id,
        weight_update_timeout_s=args.weight_update_timeout_s,
    )


def build_app(service: RolloutService, max_batch_size: int, max_body_bytes: int):
    """The aiohttp application of `service` (routes bound to it) and its thread pools."""

    def bind(table):
        return {path: (lambda body, method=method: method(service, body)) for path, method in table.items()}

    # Room for a full batch of single-row /generate calls plus health checks (threads start on demand).
    generation = cf.ThreadPoolExecutor(max_batch_size + 32, thread_name_prefix="rollout-generate")
    control = cf.ThreadPoolExecutor(16, thread_name_prefix="rollout-control")
    app = http_app.build_app(
        bind(GET_ROUTES),
        bind(POST_ROUTES),
        lambda path: generation if path in GENERATION_PATHS else control,
        max_body_bytes=max_body_bytes,
    )
    return app, (generation, control)


def main(argv: list[str] | None = None) -> int:
    """Run the embedded rollout server until interrupted."""
    parser = add_serve_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    if args.max_body_mb <= 0:
        parser.error(f"--max-body-mb must be > 0, got {args.max_body_mb}")
    if args.kv_pool_mb < 0:
        parser.error(f"--kv-pool-mb must be >= 0, got {args.kv_pool_mb}")
    if args.dp_size < 1:
        parser.error(f"--dp-size must be >= 1, got {args.dp_size}")
    if args.tp_size < 1:
        parser.error(f"--tp-size must be >= 1, got {args.tp_size}")
    if args.base_gpu_id < 0:
        parser.error(f"--base-gpu-id must be >= 0, got {args.base_gpu_id}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:  # before the model loads (or a checkpoint is exported): a busy port fails at once
        sock = http_app.bind(args.host, args.port)
    except OSError as err:
        print(
            f"megatron-gspo serve: cannot listen on {args.host}:{args.port}: {err.strerror or err}; "
            "choose another --port (or --port 0 for a free one)",
            file=sys.stderr,
        )
        return 2
    from megatron_gspo.checkpoint.source import hf_checkpoint_dir
    from megatron_gspo.config import ConfigError

    # SIGTERM before serving (while a training checkpoint is exported, or the model loads) unwinds
    # like Ctrl-C, so the temporary export is removed; once serving, the server's own handler stops it.
    signal.signal(signal.SIGTERM, _interrupt)
    with contextlib.ExitStack() as stack:  # a training checkpoint's export lives as long as the server
        stack.callback(sock.close)
        try:
            args.model = str(stack.enter_context(hf_checkpoint_dir(args.model, "--model")))
            return _serve(args, sock)
        except ConfigError as err:
            print(f"megatron-gspo serve: {err}", file=sys.stderr, flush=True)
            return 2
        except _Terminated:
            return 128 + signal.SIGTERM


class _Terminated(KeyboardInterrupt):
    """SIGTERM before the server serves."""


def _interrupt(signum, frame) -> None:
    raise _Terminated


def _serve(args: argparse.Namespace, sock) -> int:
    service = build_service(args)
    service.host, service.port = sock.getsockname()[:2]
    app, pools = build_app(service, args.max_batch_size, int(args.max_body_mb * 2**20))
    # torch, transformers and the model live as long as the server: frozen, they are not
    # rescanned by each full collection (0.2 s apiece mid-run, as SGLang's freeze_gc avoids).
    gc.collect()
    gc.freeze()
    # The launcher waits for this line (it carries the port when --port 0 was given); the
    # socket already listens, so connections made right after it queue in the backlog.
    print(f"embedded rollout server listening on http://{service.host}:{service.port}", flush=True)
    try:
        http_app.serve(app, sock)
    finally:
        service.scheduler.close()
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
        sock.close()
    return 0
