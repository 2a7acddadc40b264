"""The embedded rollout server: SGLang's HTTP protocol over an HF transformers Qwen3-MoE.

SGLang cannot run on CPU machines, so CPU runs (development, CI, the demo) serve rollouts
with this server; the trainer talks to it with the same client it uses for real SGLang.
What it implements, and how it differs from SGLang:

- POST /generate: SGLang's request contract (same 400s), single or batch (`input_ids` as
  a list of lists) requests, log-probs, routed experts; see `engine.py` for the exact
  log-prob and routing definitions. Concurrent requests are batched (`server_scheduler.py`).
  Not implemented (400 naming the field): streaming, stop strings, penalties, n > 1, top
  log-probs, constrained decoding. No prefix cache (`cached_tokens` is always 0).
- POST /update_weights_from_disk: really reloads safetensors from `model_path` (same
  architecture), all-or-nothing; /update_weights_from_tensor: base64 safetensors payload
  (`server_protocol.serialize_named_tensors`) instead of SGLang's CUDA-IPC pickle.
- POST /pause_generation, /continue_generation, /abort_request, /flush_cache (no-op: there
  is no cache between requests); GET /health, /health_generate, /get_model_info,
  /get_server_info, /get_weight_version (and their un-prefixed aliases).

    megatron-gspo serve --model DIR --port 30000
    python -m megatron_gspo.rollout.server --model DIR --port 30000
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from megatron_gspo.rollout import contract
from megatron_gspo.rollout.engine import GenerationEngine, GenerationInput, SamplingOptions
from megatron_gspo.rollout.server_protocol import (
    TENSOR_LOAD_FORMAT,
    RequestError,
    build_response,
    check_response,
    deserialize_named_tensors,
    parse_generate,
)
from megatron_gspo.rollout.server_scheduler import BatchScheduler
from megatron_gspo.rollout.weight_receiver import WeightReceiver, WeightSyncError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DISK_LOAD_FORMATS = (None, "auto", "safetensors")


class RolloutService:
    """Endpoint logic, independent of the HTTP layer: each method returns (status, JSON body or text)."""

    def __init__(self, engine: GenerationEngine, scheduler: BatchScheduler, *, check_responses: bool = False):
        self.engine = engine
        self.scheduler = scheduler
        self.check_responses = check_responses
        self.receiver = WeightReceiver(engine)
        self.host = ""
        self.port = 0

    # ------------------------------------------------------------- generation
    def generate(self, body: Any) -> tuple[int, Any]:
        """POST /generate."""
        start = time.perf_counter()
        api = contract.load()
        contract_error = api.JsonContractError if api is not None else ()
        if not isinstance(body, dict):
            return HTTPStatus.BAD_REQUEST, {"error": "invalid type: request body must be a JSON object"}
        try:
            parsed = parse_generate(body, self.engine.tokenizer)
        except contract_error as exc:
            return HTTPStatus.BAD_REQUEST, {"error": str(exc)}
        except (RequestError, TypeError, ValueError) as exc:
            return HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc)}}
        try:
            for row in parsed.rows:
                self.engine.check_input(row)
        except ValueError as exc:
            return HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc)}}
        futures = [self.scheduler.submit(rid, row) for rid, row in zip(parsed.rids, parsed.rows)]
        outputs = [f.result() for f in futures]
        latency = time.perf_counter() - start
        responses = [
            build_response(parsed, i, out, self.engine.tokenizer, latency) for i, out in enumerate(outputs)
        ]
        if self.check_responses:
            for response in responses:
                check_response(response)
        return HTTPStatus.OK, responses if parsed.is_batch else responses[0]

    def health_generate(self) -> tuple[int, Any]:
        """GET /health_generate: one real token through the batcher."""
        row = GenerationInput(
            input_ids=[self.engine.pad_token_id], sampling=SamplingOptions(max_new_tokens=1)
        )
        self.scheduler.submit("health_generate", row).result(timeout=60)
        return HTTPStatus.OK, ""

    # ---------------------------------------------------------------- weights
    def update_weights_from_disk(self, body: dict) -> tuple[int, Any]:
        """POST /update_weights_from_disk (`model_path`, `load_format`, `weight_version`, ...)."""
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            return _failure("model_path (a checkpoint directory) is required")
        if body.get("load_format") not in _DISK_LOAD_FORMATS:
            return _failure(
                f"load_format={body.get('load_format')!r} unsupported; use one of {_DISK_LOAD_FORMATS}"
            )
        if body.get("abort_all_requests"):
            self.scheduler.abort_all()
        try:
            self.engine.update_weights_from_disk(model_path, body.get("weight_version"))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, old weights kept
            logger.warning("update_weights_from_disk(%s) failed: %s", model_path, exc)
            return _failure(
                f"Failed to update weights from {model_path}: {exc}. Rolled back to the previous weights."
            )
        body_out = _success(f"Succeeded to update model weights from {model_path}.")
        body_out[1]["num_paused_requests"] = 0
        return body_out

    def update_weights_from_tensor(self, body: dict) -> tuple[int, Any]:
        """POST /update_weights_from_tensor (`serialized_named_tensors` from `serialize_named_tensors`)."""
        if body.get("load_format") not in (None, TENSOR_LOAD_FORMAT):
            return _failure(
                f"load_format={body.get('load_format')!r} unsupported; use {TENSOR_LOAD_FORMAT!r}"
            )
        if "serialized_named_tensors" not in body:
            return _failure("serialized_named_tensors is required")
        if body.get("abort_all_requests"):
            self.scheduler.abort_all()
        try:
            tensors = deserialize_named_tensors(body["serialized_named_tensors"])
            if self.receiver.session_open:  # staged; applied with the rest at /end_weight_update
                count = self.receiver.stage(tensors, body.get("weight_version"))
            else:
                count = self.engine.update_weights_from_tensors(tensors, body.get("weight_version"))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, old weights kept
            return _failure(f"Failed to update weights from tensors: {exc}")
        return _success(f"Succeeded to update {count} tensors.")

    # ------------------------------------------------- distributed weight update
    def init_weights_update_group(self, body: dict) -> tuple[int, Any]:
        """POST /init_weights_update_group: join the trainer's group (blocks until all ranks join)."""
        fields = _typed_fields(
            body,
            master_address=(str, None),
            master_port=(int, None),
            rank_offset=(int, None),
            world_size=(int, None),
            group_name=(str, "weight_update_group"),
            backend=(str, "nccl"),
        )
        if isinstance(fields, str):
            return _failure(fields)
        return self._protocol_step(
            lambda: self.receiver.init_group(**fields), "Succeeded to initialize custom process group."
        )

    def destroy_weights_update_group(self, body: dict) -> tuple[int, Any]:
        """POST /destroy_weights_update_group."""
        fields = _typed_fields(body, group_name=(str, "weight_update_group"))
        if isinstance(fields, str):
            return _failure(fields)
        return self._protocol_step(
            lambda: self.receiver.destroy_group(fields["group_name"]),
            "Succeeded to destroy custom process group.",
        )

    def begin_weight_update(self, body: dict) -> tuple[int, Any]:
        """POST /begin_weight_update: open a session (updates are staged until its end)."""
        return self._protocol_step(self.receiver.begin, "Success")

    def end_weight_update(self, body: dict) -> tuple[int, Any]:
        """POST /end_weight_update: apply the session's staged tensors all at once (`abort`: discard)."""
        fields = _typed_fields(body, abort=(bool, False))
        if isinstance(fields, str):
            return _failure(fields)
        return self._protocol_step(lambda: self.receiver.end(**fields), "Success")

    def update_weights_from_distributed(self, body: dict) -> tuple[int, Any]:
        """POST /update_weights_from_distributed: receive one broadcast bucket from the trainer."""
        fields = _typed_fields(
            body,
            names=(list, None),
            dtypes=(list, None),
            shapes=(list, None),
            group_name=(str, "weight_update_group"),
            load_format=(str, ""),
            weight_version=(str, ""),
        )
        if isinstance(fields, str):
            return _failure(fields)
        if body.get("abort_all_requests"):
            self.scheduler.abort_all()
        fields["load_format"] = fields["load_format"] or None
        fields["weight_version"] = fields["weight_version"] or None
        return self._protocol_step(
            lambda: self.receiver.receive(**fields), "Succeeded to update parameter online."
        )

    def _protocol_step(self, step, message: str) -> tuple[int, Any]:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - reported to the caller; the old weights keep serving
            logger.warning("weight-update protocol step failed: %s", exc)
            return _failure(str(exc) if isinstance(exc, WeightSyncError) else f"{type(exc).__name__}: {exc}")
        return _success(message)

    # ----------------------------------------------------------------- control
    def pause_generation(self, body: dict) -> tuple[int, Any]:
        """POST /pause_generation (`mode`: abort (default), retract, in_place)."""
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return HTTPStatus.BAD_REQUEST, {"error": {"message": f"unknown pause mode {mode!r}"}}
        self.scheduler.pause(abort=mode == "abort")
        return HTTPStatus.OK, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict) -> tuple[int, Any]:
        """POST /continue_generation."""
        self.scheduler.resume()
        return HTTPStatus.OK, {"message": "Generation continued successfully.", "status": "ok"}

    def abort_request(self, body: dict) -> tuple[int, Any]:
        """POST /abort_request (`rid` or `abort_all`)."""
        if body.get("abort_all"):
            self.scheduler.abort_all()
        elif body.get("rid"):
            self.scheduler.abort(str(body["rid"]))
        return HTTPStatus.OK, ""

    def flush_cache(self, body: dict) -> tuple[int, Any]:
        """GET/POST /flush_cache: nothing is cached across requests, so always succeeds."""
        return HTTPStatus.OK, "Cache flushed.\n"

    def model_info(self) -> dict:
        """GET /get_model_info."""
        cfg = self.engine.model.config
        return {
            "model_path": self.engine.model_path,
            "tokenizer_path": self.engine.model_path,
            "served_model_name": self.engine.model_path,
            "is_generation": True,
            "weight_version": self.engine.weight_version,
            "load_format": "safetensors",
            "model_type": cfg.model_type,
            "architectures": cfg.architectures,
        }

    def server_info(self) -> dict:
        """GET /get_server_info."""
        return {
            "model_path": self.engine.model_path,
            "tokenizer_path": self.engine.model_path,
            "weight_version": self.engine.weight_version,
            "host": self.host,
            "port": self.port,
            "context_length": self.engine.context_len,
            "tp_size": 1,  # one rank in a weight-update group
            "dp_size": 1,
            "enable_return_routed_experts": True,
            "return_original_logprob": self.engine.return_original_logprob,
            "max_running_requests": self.scheduler.max_batch_size,
            "num_pending_requests": self.scheduler.num_pending,
            "version": "embedded",
        }


def _success(message: str) -> tuple[int, dict]:
    return HTTPStatus.OK, {"success": True, "message": message}


def _failure(message: str) -> tuple[int, dict]:
    return HTTPStatus.BAD_REQUEST, {"success": False, "message": message}


def _typed_fields(body: dict, **spec: tuple[type, Any]) -> dict[str, Any] | str:
    """`body`'s fields by `name=(type, default)` (default None: required), or an error naming the field."""
    out = {}
    for name, (kind, default) in spec.items():
        value = body.get(name)
        value = default if value is None else value
        if value is None:
            return f"{name} is required"
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"{name} must be {kind.__name__}, got {type(value).__name__}"
        out[name] = value
    return out


def make_handler(service: RolloutService) -> type[BaseHTTPRequestHandler]:
    """An HTTP handler class routing SGLang's paths to `service`."""
    get_routes = {
        "/health": lambda: (HTTPStatus.OK, ""),
        "/health_generate": service.health_generate,
        "/get_model_info": lambda: (HTTPStatus.OK, service.model_info()),
        "/model_info": lambda: (HTTPStatus.OK, service.model_info()),
        "/get_server_info": lambda: (HTTPStatus.OK, service.server_info()),
        "/server_info": lambda: (HTTPStatus.OK, service.server_info()),
        "/get_weight_version": lambda: (HTTPStatus.OK, {"weight_version": service.engine.weight_version}),
        "/weight_version": lambda: (HTTPStatus.OK, {"weight_version": service.engine.weight_version}),
        "/flush_cache": lambda: service.flush_cache({}),
    }
    post_routes = {
        "/generate": service.generate,
        "/update_weights_from_disk": service.update_weights_from_disk,
        "/update_weights_from_tensor": service.update_weights_from_tensor,
        "/init_weights_update_group": service.init_weights_update_group,
        "/destroy_weights_update_group": service.destroy_weights_update_group,
        "/begin_weight_update": service.begin_weight_update,
        "/end_weight_update": service.end_weight_update,
        "/update_weights_from_distributed": service.update_weights_from_distributed,
        "/pause_generation": service.pause_generation,
        "/continue_generation": service.continue_generation,
        "/abort_request": service.abort_request,
        "/flush_cache": service.flush_cache,
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            logger.debug("%s " + format, self.address_string(), *args)

        def do_GET(self) -> None:  # noqa: N802 - stdlib naming
            route = get_routes.get(self.path.split("?", 1)[0])
            if route is None:
                self._send(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})
                return
            self._run(route)

        def do_POST(self) -> None:  # noqa: N802 - stdlib naming
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            route = post_routes.get(self.path.split("?", 1)[0])
            if route is None:
                self._send(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})
                return
            try:
                body = json.loads(raw) if raw else {}
            except json.JSONDecodeError as exc:
                self._send(HTTPStatus.BAD_REQUEST, {"error": {"message": f"request body is not JSON: {exc}"}})
                return
            if self.path.startswith("/generate"):
                self._run(lambda: route(body))
            elif not isinstance(body, dict):
                self._send(
                    HTTPStatus.BAD_REQUEST, {"error": {"message": "request body must be a JSON object"}}
                )
            else:
                self._run(lambda: route(body))

        def _run(self, route) -> None:
            try:
                status, payload = route()
            except Exception as exc:  # noqa: BLE001 - a server error must still answer the client
                logger.exception("error serving %s", self.path)
                status, payload = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": repr(exc)}}
            self._send(status, payload)

        def _send(self, status: int, payload: Any) -> None:
            if isinstance(payload, str):
                data, ctype = payload.encode(), "text/plain; charset=utf-8"
            else:
                data, ctype = json.dumps(payload).encode(), "application/json"
            self.send_response(int(status))
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of `megatron-gspo serve` (and `python -m megatron_gspo.rollout.server`)."""
    parser.add_argument(
        "--model", required=True, help="HF checkpoint directory (safetensors + config + tokenizer)"
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
    parser.add_argument("--log-level", default="warning", help="python logging level")
    return parser


def build_server(args: argparse.Namespace) -> tuple[ThreadingHTTPServer, RolloutService]:
    """Load the model and bind the HTTP server (not yet serving)."""
    engine = GenerationEngine(
        args.model,
        dtype=_DTYPES[args.dtype],
        return_original_logprob=args.return_original_logprob,
        weight_version=args.weight_version,
        seed=args.seed,
    )
    scheduler = BatchScheduler(
        engine, batch_window_s=args.batch_window_ms / 1000, max_batch_size=args.max_batch_size
    )
    service = RolloutService(engine, scheduler, check_responses=args.check_responses)
    httpd = ThreadingHTTPServer((args.host, args.port), make_handler(service))
    httpd.daemon_threads = True
    service.host, service.port = httpd.server_address[:2]
    return httpd, service


def main(argv: list[str] | None = None) -> int:
    """Run the embedded rollout server until interrupted."""
    parser = add_serve_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    httpd, service = build_server(args)
    # The launcher waits for this line (it carries the port when --port 0 was given).
    print(f"embedded rollout server listening on http://{service.host}:{service.port}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        service.scheduler.close()
        httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
