"""The embedded server's endpoints, each as SGLang answers it, and its route tables (see the package)."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import time
import uuid
from http import HTTPStatus
from typing import Any

import torch

from megatron_gspo.rollout import contract
from megatron_gspo.rollout.server.engine import GenerationEngine, GenerationInput, SamplingOptions
from megatron_gspo.rollout.server.fields import (
    RequestError,
    check_bool,
    check_int,
    check_object,
    check_str,
    show,
)
from megatron_gspo.rollout.server.memory import MemoryOccupationError, check_tags
from megatron_gspo.rollout.server.protocol import build_response, check_response, parse_generate
from megatron_gspo.rollout.server.scheduler import BatchScheduler
from megatron_gspo.rollout.server.weight_receiver import WeightReceiver, WeightSyncError
from megatron_gspo.weight_sync import tensor_handles

logger = logging.getLogger(__name__)


_DISK_LOAD_FORMATS = (None, "auto", "safetensors")
HEALTH_CHECK_TIMEOUT_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"
"""SGLang's own variable (`http_server.HEALTH_CHECK_TIMEOUT`, an int, default 20): how long /health
and /health_generate wait for the scheduler before answering 503. Tests set it to seconds."""
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
"""SGLang's switch (`environ.py`, default true): false makes /health (not /health_generate) a 200
that generates nothing."""
HEALTH_POLL_S = 0.05
"""How often a health check looks for the batcher's tokens (SGLang looks once a second)."""


def health_check_timeout_s() -> float:
    """SGLang's health timeout: `SGLANG_HEALTH_CHECK_TIMEOUT` seconds (an int there), default 20."""
    return float(int(os.environ.get(HEALTH_CHECK_TIMEOUT_ENV, "20")))


def health_endpoint_generates() -> bool:
    """`SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` as SGLang's `EnvBool` parses it (default true)."""
    value = os.environ.get(HEALTH_GENERATION_ENV, "true").strip().lower()
    if value in ("true", "1", "yes", "y"):
        return True
    if value in ("false", "0", "no", "n"):
        return False
    raise ValueError(f"{HEALTH_GENERATION_ENV}={value!r}: expected true/false")


class RolloutService:
    """Endpoint logic, independent of the HTTP layer: each method takes the JSON body, returns (status, body).

    A field the method reads with the wrong type is a 400 naming it (`RequestError`).
    """

    def __init__(
        self,
        engine: GenerationEngine,
        scheduler: BatchScheduler,
        *,
        check_responses: bool = False,
        dp_size: int = 1,
        tp_size: int = 1,
        base_gpu_id: int = 0,
        weight_update_timeout_s: float = 1800.0,
    ):
        self.engine = engine
        self.scheduler = scheduler
        self.check_responses = check_responses
        self.dp_size = dp_size  # reported as SGLang's; > 1 refuses what SGLang refuses (see `_dp_refusal`)
        self.tp_size = tp_size  # reported as SGLang's; each rank opens its own tensor-handle entry
        self.base_gpu_id = base_gpu_id
        self.receiver = WeightReceiver(engine, timeout_s=weight_update_timeout_s)
        self.host = ""
        self.port = 0
        # /get_server_info serialises SGLang's launch arguments: what the server was started on,
        # never what a weight update set since (that is /model_info's).
        self.launch_model_path = engine.model_path
        self.launch_weight_version = engine.weight_version
        self.health_timeout_s = health_check_timeout_s()
        self.health_generates = health_endpoint_generates()

    # ------------------------------------------------------------- generation
    def generate(self, body: Any) -> tuple[int, Any]:
        """POST /generate."""
        start = time.perf_counter()
        api = contract.load()
        contract_error = api.JsonContractError if api is not None else ()
        try:
            parsed = parse_generate(body, self.engine.tokenizer)
            for row in parsed.rows:
                self.engine.check_input(row)
        except contract_error as exc:
            return HTTPStatus.BAD_REQUEST, {"error": str(exc)}  # SGLang's own wording and layout
        except ValueError as exc:  # RequestError, or the engine's refusal
            return HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc)}}
        try:  # refused while memory is released (SGLang would run the forward on freed memory)
            self.engine.memory.check_generation()
            futures = self.scheduler.submit_many(parsed.rids, parsed.rows)
            outputs = [f.result() for f in futures]
        except MemoryOccupationError as exc:  # also rows queued in a pause, released meanwhile
            return _bad_request(str(exc))
        latency = time.perf_counter() - start
        responses = [
            build_response(parsed, i, out, self.engine.tokenizer, latency) for i, out in enumerate(outputs)
        ]
        if self.check_responses:
            for response in responses:
                check_response(response)
        return HTTPStatus.OK, responses if parsed.is_batch else responses[0]

    def health(self, body: Any) -> tuple[int, Any]:
        """GET /health: as /health_generate (SGLang 0.5.23 serves both with one handler).

        Unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false: then 200 at once, nothing generated.
        """
        if not self.health_generates:
            return HTTPStatus.OK, ""
        return self.health_generate(body)

    def ready(self, body: Any) -> tuple[int, Any]:
        """GET /ready: 503 while generation is paused, else 200, nothing generated (SGLang's `is_ready`)."""
        return (HTTPStatus.SERVICE_UNAVAILABLE if self.scheduler.paused else HTTPStatus.OK), ""

    def health_generate(self, body: Any) -> tuple[int, Any]:
        """GET /health_generate: 200 once the batcher shows life, 503 after SGLang's health timeout.

        As SGLang's `health_generate`: one token is asked for (input [pad], greedy); the answer
        is 200 as soon as the batcher produces any token (this one or another request's: SGLang
        takes any scheduler output as life), else 503 after `health_timeout_s`
        (SGLANG_HEALTH_CHECK_TIMEOUT, default 20 s). While generation is paused the row waits in
        the paused queue, as SGLang's request waits at the pause: the answer is 503 after the
        timeout, or 200 if generation continues within it.
        """
        rid = f"health_generate-{uuid.uuid4().hex}"
        row = GenerationInput(
            input_ids=[self.engine.pad_token_id], sampling=SamplingOptions(max_new_tokens=1)
        )
        tokens_before = self.engine.tokens_generated
        deadline = time.monotonic() + self.health_timeout_s
        try:
            future = self.scheduler.submit(rid, row)
        except RuntimeError:  # closed: SGLang answers 503 during shutdown too
            return HTTPStatus.SERVICE_UNAVAILABLE, {"message": "server shutting down"}
        while (left := deadline - time.monotonic()) > 0:
            try:
                out = future.result(timeout=min(left, HEALTH_POLL_S))
            except cf.TimeoutError:
                if self.engine.tokens_generated > tokens_before:  # the batcher is producing
                    self.scheduler.abort(rid)
                    return HTTPStatus.OK, ""
                continue
            except Exception as exc:  # noqa: BLE001 - an engine failure means unhealthy, not a crash
                return HTTPStatus.SERVICE_UNAVAILABLE, {"message": f"generation failed: {exc}"}
            if out.finish_reason.get("type") == "abort":
                return HTTPStatus.SERVICE_UNAVAILABLE, {"message": "health generation aborted"}
            return HTTPStatus.OK, ""
        self.scheduler.abort(rid)
        paused = " (generation is paused)" if self.scheduler.paused else ""
        return HTTPStatus.SERVICE_UNAVAILABLE, {
            "message": f"no token generated within {self.health_timeout_s:g} s{paused}"
        }

    # ---------------------------------------------------------------- weights
    def update_weights_from_disk(self, body: Any) -> tuple[int, Any]:
        """POST /update_weights_from_disk (`model_path`, `load_format`, `weight_version`, ...)."""
        try:
            body = check_object(body)
            model_path, version, abort = _update_fields(body)
            if model_path is None or not model_path:
                raise RequestError("model_path (a checkpoint directory) is required")
        except RequestError as exc:
            return _failure(str(exc))
        if body.get("load_format") not in _DISK_LOAD_FORMATS:
            return _failure(
                f"load_format={body.get('load_format')!r} unsupported; use one of {_DISK_LOAD_FORMATS}"
            )
        if abort:
            self.scheduler.abort_all()
        try:
            self.engine.update_weights_from_disk(model_path, version)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, old weights kept
            logger.warning("update_weights_from_disk(%s) failed: %s", model_path, exc)
            return _failure(
                f"Failed to update weights from {model_path}: {exc}. Rolled back to the previous weights."
            )
        body_out = _success(f"Succeeded to update model weights from {model_path}.")
        body_out[1]["num_paused_requests"] = 0
        return body_out

    def update_weights_from_tensor(self, body: Any) -> tuple[int, Any]:
        """POST /update_weights_from_tensor: SGLang's tensor handles (`rollout.tensor_handles`), in a session.

        As SGLang 0.5.23: `serialized_named_tensors` holds one base64 `MultiprocessingSerializer`
        entry per TP rank, and TP rank r opens entry r only (`tp_worker.deserialize_own_rank`); a
        list shorter than `tp_size` is refused naming the rank left without one (SGLang's rank fails
        on the missing index). This server computes as one rank: it opens every rank's entry and
        refuses entries whose tensors differ from rank 0's (SGLang's ranks would load different
        weights, silently); `load_format` None or `flattened_bucket`; refused outside a begin/end
        weight-update session with SGLang's message. The tensors are copied out of the sender's
        memory (shared memory on CPU, CUDA IPC on GPU) and loaded at once, as SGLang loads each
        request's tensors.
        """
        try:
            body = check_object(body)
            _, version, abort = _update_fields(body)
            load_format = body.get("load_format")
            if load_format is not None:
                check_str(load_format, "load_format")
        except RequestError as exc:
            return _failure(str(exc))
        if load_format not in tensor_handles.LOAD_FORMATS:
            return _failure(
                f"load_format={load_format!r} unsupported; use one of {list(tensor_handles.LOAD_FORMATS)}"
            )
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries:
            return _failure("serialized_named_tensors must be a list of base64 entries, one per TP rank")
        if len(entries) < self.tp_size:
            return _failure(
                f"serialized_named_tensors has {len(entries)} entries for a server of tp_size "
                f"{self.tp_size}: TP rank {len(entries)} has none (one entry per TP rank)"
            )
        if self.dp_size > 1:
            return _dp_refusal("update weights from tensor")
        if abort:
            self.scheduler.abort_all()
        if not self.receiver.session_open:  # SGLang's scheduler refuses it so (weight_updater.py)
            return _failure(
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
            )
        try:
            # Copies: the sender's memory is released once it has our answer.
            opened = [
                {name: t.clone() for name, t in tensor_handles.named_tensors(
                    tensor_handles.deserialize(entry), load_format).items()}
                for entry in entries[: self.tp_size]
            ]  # fmt: skip
            _refuse_ranks_apart(opened)
            count = self.receiver.load(opened[0], version)
        except Exception as exc:  # noqa: BLE001 - reported to the caller; this request loaded nothing
            return _failure(f"Failed to update weights from tensors: {exc}")
        return _success(f"Succeeded to update {count} tensors.")

    # ------------------------------------------------- distributed weight update
    def init_weights_update_group(self, body: Any) -> tuple[int, Any]:
        """POST /init_weights_update_group: join the trainer's group (blocks until all ranks join)."""
        try:
            body = check_object(body)
            fields = {
                "master_address": check_str(_required(body, "master_address"), "master_address"),
                "master_port": check_int(_required(body, "master_port"), "master_port", 1, 65535),
                "rank_offset": check_int(_required(body, "rank_offset"), "rank_offset"),
                "world_size": check_int(_required(body, "world_size"), "world_size", 2),
                "group_name": check_str(body.get("group_name", "weight_update_group"), "group_name"),
                "backend": check_str(body.get("backend", "nccl"), "backend"),
            }
        except RequestError as exc:
            return _failure(str(exc))
        if self.dp_size > 1:
            return _dp_refusal("init parameter update group")
        if self.tp_size > 1:
            return _failure(
                f"this embedded server computes as one process and cannot join a weight-update group "
                f"as its tp_size={self.tp_size} ranks; sync its weights by tensor handles "
                "(weight_sync.method=tensor)"
            )
        return self._protocol_step(
            lambda: self.receiver.init_group(**fields), "Succeeded to initialize custom process group."
        )

    def destroy_weights_update_group(self, body: Any) -> tuple[int, Any]:
        """POST /destroy_weights_update_group."""
        try:
            name = check_str(check_object(body).get("group_name", "weight_update_group"), "group_name")
        except RequestError as exc:
            return _failure(str(exc))
        return self._protocol_step(
            lambda: self.receiver.destroy_group(name), "Succeeded to destroy custom process group."
        )

    def begin_weight_update(self, body: Any) -> tuple[int, Any]:
        """POST /begin_weight_update: open a session (each update inside it loads as it arrives)."""
        return self._protocol_step(self.receiver.begin, "Success")

    def end_weight_update(self, body: Any) -> tuple[int, Any]:
        """POST /end_weight_update: close the session (`abort` changes nothing, as SGLang ignores it)."""
        try:
            abort = check_bool(check_object(body).get("abort"), "abort", False)
        except RequestError as exc:
            return _failure(str(exc))
        return self._protocol_step(lambda: self.receiver.end(abort=abort), "Success")

    def update_weights_from_distributed(self, body: Any) -> tuple[int, Any]:
        """POST /update_weights_from_distributed: receive one broadcast bucket from the trainer."""
        try:
            body = check_object(body)
            _, version, abort = _update_fields(body)
            fields = {name: _required(body, name) for name in ("names", "dtypes", "shapes")}
            for name, value in fields.items():
                if not isinstance(value, list):
                    raise RequestError(f"{name} must be a list, got {show(value)}")
            group_name = check_str(body.get("group_name", "weight_update_group"), "group_name")
            load_format = body.get("load_format")
            if load_format is not None:
                check_str(load_format, "load_format")
        except RequestError as exc:
            return _failure(str(exc))
        if abort:
            self.scheduler.abort_all()
        return self._protocol_step(
            lambda: self.receiver.receive(
                **fields, group_name=group_name, load_format=load_format, weight_version=version
            ),
            "Succeeded to update parameter online.",
        )

    def _protocol_step(self, step, message: str) -> tuple[int, Any]:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - reported to the caller; that step loaded nothing
            logger.warning("weight-update protocol step failed: %s", exc)
            return _failure(str(exc) if isinstance(exc, WeightSyncError) else f"{type(exc).__name__}: {exc}")
        return _success(message)

    # ------------------------------------------------------------------ memory
    def release_memory_occupation(self, body: Any) -> tuple[int, Any]:
        """GET/POST /release_memory_occupation (`tags` of kv_cache, weights, cuda_graph; none: all).

        SGLang answers 200 with a `null` body; it needs `--enable-memory-saver` and an idle server
        (see `memory.py` for where this refuses what SGLang crashes on).
        """
        try:
            tags = check_tags(check_object(body).get("tags"))
        except ValueError as exc:  # RequestError too
            return _bad_request(str(exc))
        if not self.scheduler.idle_for_flush():  # SGLang's assertion, which kills its scheduler
            return _bad_request(
                "ServerBusy: release_memory_occupation should be called only when server is idle."
            )
        try:
            self.engine.release_memory(tags)
        except MemoryOccupationError as exc:
            return _bad_request(str(exc))
        return HTTPStatus.OK, None

    def resume_memory_occupation(self, body: Any) -> tuple[int, Any]:
        """GET/POST /resume_memory_occupation (`tags` as for release): 200 with a `null` body."""
        try:
            tags = check_tags(check_object(body).get("tags"))
            self.engine.resume_memory(tags)
        except (ValueError, MemoryOccupationError) as exc:
            return _bad_request(str(exc))
        return HTTPStatus.OK, None

    # ----------------------------------------------------------------- control
    def pause_generation(self, body: Any) -> tuple[int, Any]:
        """POST /pause_generation (`mode`: abort (default), retract, in_place)."""
        try:
            mode = check_str(check_object(body).get("mode", "abort"), "mode")
        except RequestError as exc:
            return _bad_request(str(exc))
        if mode not in ("abort", "retract", "in_place"):
            return _bad_request(f"mode: unknown pause mode {mode!r}")
        self.scheduler.pause(mode)
        return HTTPStatus.OK, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: Any) -> tuple[int, Any]:
        """POST /continue_generation."""
        try:
            check_object(body)
        except RequestError as exc:
            return _bad_request(str(exc))
        self.scheduler.resume()
        return HTTPStatus.OK, {"message": "Generation continued successfully.", "status": "ok"}

    def abort_request(self, body: Any) -> tuple[int, Any]:
        """POST /abort_request (`rid` or `abort_all`)."""
        try:
            body = check_object(body)
            abort_all = check_bool(body.get("abort_all"), "abort_all", False)
            rid = body.get("rid")
            rid = None if rid in (None, "") else check_str(rid, "rid")
        except RequestError as exc:
            return _bad_request(str(exc))
        if abort_all:
            self.scheduler.abort_all()
        elif rid is not None:
            self.scheduler.abort(rid)
        return HTTPStatus.OK, ""

    def flush_cache(self, body: Any) -> tuple[int, Any]:
        """GET/POST /flush_cache: nothing is cached across requests, yet refused as SGLang refuses it.

        SGLang flushes only when idle: 400 while a batch runs or is held by an `in_place` pause,
        or while requests are queued outside a pause (`BatchScheduler.idle_for_flush`).
        """
        try:
            check_object(body)
        except RequestError as exc:
            return _bad_request(str(exc))
        if not self.scheduler.idle_for_flush():
            return HTTPStatus.BAD_REQUEST, "Flush cache failed.\n"  # SGLang's text, no message given
        return HTTPStatus.OK, "Cache flushed.\n"

    def model_info(self, body: Any = None) -> tuple[int, Any]:
        """GET /model_info (and deprecated /get_model_info): the live model_path and weight_version.

        As SGLang's `model_info`: what weight updates change is reported here.
        """
        cfg = self.engine.model.config
        return HTTPStatus.OK, {
            "model_path": self.engine.model_path,
            "tokenizer_path": self.engine.model_path,
            "served_model_name": self.engine.model_path,
            "is_generation": True,
            "weight_version": self.engine.weight_version,
            "load_format": "safetensors",
            "model_type": cfg.model_type,
            "architectures": cfg.architectures,
        }

    def server_info(self, body: Any = None) -> tuple[int, Any]:
        """GET /server_info (and deprecated /get_server_info): the launch arguments, plus live counters.

        As SGLang's `server_info`, `model_path` and `weight_version` are the launch values (its
        answer serialises the server arguments); /model_info has the live ones.
        `num_pending_requests` and `num_generated_tokens` are not SGLang's (tests read them).
        """
        return HTTPStatus.OK, {
            "model_path": self.launch_model_path,
            "tokenizer_path": self.launch_model_path,
            "weight_version": self.launch_weight_version,
            "host": self.host,
            "port": self.port,
            "context_length": self.engine.context_len,
            "tp_size": self.tp_size,
            "pp_size": 1,  # as SGLang reports it: start-up checks refuse pp_size > 1 for group / tensor sync
            "device": self.engine.device.type,  # SGLang's launch argument: `auto` picks NCCL on "cuda"
            "base_gpu_id": self.base_gpu_id,
            "gpu_id_step": 1,
            "dp_size": self.dp_size,
            "enable_dp_attention": False,
            "enable_return_routed_experts": True,
            "enable_memory_saver": self.engine.memory.enabled,
            "enable_weights_cpu_backup": False,
            "return_original_logprob": self.engine.return_original_logprob,
            "max_running_requests": self.scheduler.max_batch_size,
            "num_pending_requests": self.scheduler.num_pending,
            "num_generated_tokens": self.engine.tokens_generated,  # not SGLang's: see the module doc
            "version": "embedded",
        }


# The HTTP surface: path -> endpoint (SGLang's paths and their un-prefixed aliases). A new
# endpoint is a RolloutService method plus one line here.
GET_ROUTES = {
    "/health": RolloutService.health,
    "/health_generate": RolloutService.health_generate,
    "/ready": RolloutService.ready,
    "/get_model_info": RolloutService.model_info,
    "/model_info": RolloutService.model_info,
    "/get_server_info": RolloutService.server_info,
    "/server_info": RolloutService.server_info,
    "/flush_cache": RolloutService.flush_cache,
    "/release_memory_occupation": RolloutService.release_memory_occupation,
    "/resume_memory_occupation": RolloutService.resume_memory_occupation,
}
POST_ROUTES = {
    "/generate": RolloutService.generate,
    "/update_weights_from_disk": RolloutService.update_weights_from_disk,
    "/update_weights_from_tensor": RolloutService.update_weights_from_tensor,
    "/init_weights_update_group": RolloutService.init_weights_update_group,
    "/destroy_weights_update_group": RolloutService.destroy_weights_update_group,
    "/begin_weight_update": RolloutService.begin_weight_update,
    "/end_weight_update": RolloutService.end_weight_update,
    "/update_weights_from_distributed": RolloutService.update_weights_from_distributed,
    "/pause_generation": RolloutService.pause_generation,
    "/continue_generation": RolloutService.continue_generation,
    "/abort_request": RolloutService.abort_request,
    "/flush_cache": RolloutService.flush_cache,
    "/release_memory_occupation": RolloutService.release_memory_occupation,
    "/resume_memory_occupation": RolloutService.resume_memory_occupation,
}


# Calls that wait on generation run in their own thread pool, so a flood of them can never keep
# the calls that end the wait (/continue_generation, /abort_request) from running.
GENERATION_PATHS = frozenset({"/generate", "/health", "/health_generate"})


def _update_fields(body: dict) -> tuple[str | None, str | None, bool]:
    """`model_path`, `weight_version` and `abort_all_requests` of a weight update, checked."""
    model_path = body.get("model_path")
    if model_path is not None:
        check_str(model_path, "model_path")
    version = body.get("weight_version")
    if version is not None:
        version = str(version) if isinstance(version, int) and not isinstance(version, bool) else version
        check_str(version, "weight_version")
    check_bool(body.get("flush_cache"), "flush_cache", True)
    abort = check_bool(body.get("abort_all_requests"), "abort_all_requests", False)
    return model_path, version, abort


def _success(message: str) -> tuple[int, dict]:
    return HTTPStatus.OK, {"success": True, "message": message}


def _failure(message: str) -> tuple[int, dict]:
    return HTTPStatus.BAD_REQUEST, {"success": False, "message": message}


def _refuse_ranks_apart(opened: list[dict]) -> None:
    """Refuse TP ranks' entries that would load different weights (named: the rank and tensor)."""
    first = opened[0]
    for rank, tensors in enumerate(opened[1:], start=1):
        if tensors.keys() != first.keys():
            raise ValueError(f"TP rank {rank}'s entry names other tensors than rank 0's")
        for name, tensor in tensors.items():
            if tensor.dtype != first[name].dtype or not torch.equal(tensor, first[name]):
                raise ValueError(f"TP rank {rank}'s {name} differs from TP rank 0's")


def _dp_refusal(what: str) -> tuple[int, dict]:
    """SGLang's answer to a weight update it asserts needs dp_size 1: the assertion's 500."""
    return HTTPStatus.INTERNAL_SERVER_ERROR, {"success": False, "message": f"dp_size must be 1 for {what}"}


def _required(body: dict, name: str) -> Any:
    if body.get(name) is None:
        raise RequestError(f"{name} is required")
    return body[name]


def _bad_request(message: str) -> tuple[int, dict]:
    return HTTPStatus.BAD_REQUEST, {"error": {"message": message}}
