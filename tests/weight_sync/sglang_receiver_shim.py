"""An SGLang server reduced to its weight-sync endpoints, receiving with SGLang's own code (test code).

Runs in the SGLang environment (`launch/setup_sglang.sh`), never in the trainer's:

    .venv-sglang/bin/python tests/weight_sync/sglang_receiver_shim.py --tp-size 2 --dump-dir D --port-file F

What is SGLang's (0.5.23, as installed), run as it is:
- the request types of `sglang/srt/managers/io_struct.py`, validated as FastAPI does (pydantic
  through their `__get_pydantic_core_schema__`: unknown fields ignored, missing ones a 422);
- per TP rank, `SchedulerWeightUpdaterManager` (sessions: updates only between
  `/begin_weight_update` and `/end_weight_update`, weight_version recording, TP barriers),
  `BaseTpWorker.init/destroy_weights_update_group`, and `WeightUpdater` (group join as rank
  `rank_offset + tp_rank` through `init_custom_process_group`, receive of one broadcast per bucket
  into a `FlattenedTensorBucket` and its reconstruction, `load_weights_from_distributed`;
  `/update_weights_from_tensor`: `BaseTpWorker.deserialize_own_rank` (each rank opens its own entry
  with `MultiprocessingSerializer` and its `SafeUnpickler`, after `monkey_patch_torch_reductions`)
  and `WeightUpdater.update_weights_from_tensor` with `load_format="flattened_bucket"`);
- the answers' merge (`FanOutCommunicator.merge_results`) and status codes of `http_server.py`.
Their modules import torchvision (a CUDA build of SGLang's torch 2.14.1), so these classes and
functions are compiled from the installed source files, unchanged, into one namespace beside what
they call from modules that do import: `init_custom_process_group`, `NetworkAddress`,
`FlattenedTensorBucket` and the msgspec/pydantic bridge of `sglang.srt.utils`. A name the shim
looks for and SGLang no longer defines fails at start-up, naming it.

What stands in, at the boundary of a GPU model: the model whose `load_weights` takes the received
(name, tensor) pairs (here it keeps copies, written to `--dump-dir` at `/end_weight_update` as
`tp{rank}.pt` for the test to compare), SGLang's runtime context (`get_parallel`: the server's TP
group; `get_model`: no weight cache), the model loader's quantisation hooks (nothing to repack),
the scheduler's version record and the prefix-cache flush (no cache).
"""

from __future__ import annotations
import __future__

import argparse
import ast
import contextlib
import json
import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import types
import typing
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import distribution
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pydantic
import torch
import torch.distributed as dist

REQUESTS = {  # endpoint -> (io_struct request type, scheduler manager method)
    "/init_weights_update_group": ("InitWeightsUpdateGroupReqInput", "init_weights_update_group"),
    "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", "destroy_weights_update_group"),
    "/begin_weight_update": ("BeginWeightUpdateReqInput", "begin_weight_update"),
    "/end_weight_update": ("EndWeightUpdateReqInput", "end_weight_update"),
    "/update_weights_from_distributed": (
        "UpdateWeightsFromDistributedReqInput",
        "update_weights_from_distributed",
    ),
    "/update_weights_from_tensor": ("UpdateWeightsFromTensorReqInput", "update_weights_from_tensor"),
}
IO_TYPES = [name for name, _ in REQUESTS.values()] + [
    f"{name.removesuffix('Input')}Output" for name, _ in REQUESTS.values()
]


def sglang_file(relpath: str) -> Path:
    """An installed SGLang source file."""
    return Path(distribution("sglang").locate_file(f"sglang/{relpath}"))


def compile_from_sglang(namespace: types.ModuleType, relpath: str, names: list[str]) -> None:
    """Define `names` (top-level classes/functions, or `Class.method`) of an SGLang file in `namespace`.

    A `Class.method` is defined as a function named `method`. Annotations stay strings when the
    file says `from __future__ import annotations`, as they do in SGLang.
    """
    path = sglang_file(relpath)
    tree = ast.parse(path.read_text(), str(path))
    future = any(
        isinstance(n, ast.ImportFrom)
        and n.module == "__future__"
        and "annotations" in {a.name for a in n.names}
        for n in tree.body
    )
    top = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
    nodes = []
    for name in names:
        owner, _, method = name.partition(".")
        node = top.get(owner)
        if node is not None and method:
            node = next((m for m in node.body if isinstance(m, ast.FunctionDef) and m.name == method), None)
        if node is None:
            raise LookupError(f"{name} is not defined in {path}: SGLang changed; adapt the shim")
        nodes.append(node)
    flags = __future__.annotations.compiler_flag if future else 0
    code = compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec", flags=flags, dont_inherit=True)
    exec(code, namespace.__dict__)


def sglang_namespace(stand_ins: dict) -> types.ModuleType:
    """A module holding SGLang's receiver code compiled from source, its real helpers and `stand_ins`."""
    from sglang.srt.utils.common import MultiprocessingSerializer, init_custom_process_group
    from sglang.srt.utils.msgspec_utils import Base64Bytes, msgspec_struct_pydantic_core_schema
    from sglang.srt.utils.network import NetworkAddress
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    namespace = types.ModuleType("sglang_receiver_source")
    sys.modules[namespace.__name__] = namespace  # msgspec resolves string annotations through it
    namespace.__dict__.update({name: getattr(typing, name) for name in typing.__all__})
    namespace.__dict__.update(
        torch=torch,
        msgspec=msgspec,
        time=time,
        gc=__import__("gc"),
        traceback=__import__("traceback"),
        logger=logging.getLogger("sglang_receiver_source"),
        contextmanager=contextlib.contextmanager,
        dataclass=dataclass,
        field=field,
        init_custom_process_group=init_custom_process_group,
        msgspec_struct_pydantic_core_schema=msgspec_struct_pydantic_core_schema,
        Base64Bytes=Base64Bytes,
        MultiprocessingSerializer=MultiprocessingSerializer,
        monkey_patch_torch_reductions=monkey_patch_torch_reductions,
        NetworkAddress=NetworkAddress,
        FlattenedTensorBucket=FlattenedTensorBucket,
        FlattenedTensorMetadata=FlattenedTensorMetadata,
        **stand_ins,
    )
    compile_from_sglang(namespace, "srt/managers/io_struct.py", ["BaseReq", *IO_TYPES])
    compile_from_sglang(
        namespace,
        "srt/model_executor/model_runner_components/weight_updater.py",
        ["_unsupported_derived_weight_cache_error", "WeightUpdater"],
    )
    compile_from_sglang(
        namespace,
        "srt/managers/scheduler_components/weight_updater.py",
        ["_parse_runner_selector", "_WeightUpdateSession", "SchedulerWeightUpdaterManager"],
    )
    compile_from_sglang(
        namespace,
        "srt/managers/tp_worker.py",
        [
            "BaseTpWorker.init_weights_update_group",
            "BaseTpWorker.destroy_weights_update_group",
            "BaseTpWorker.deserialize_own_rank",
        ],
    )
    compile_from_sglang(namespace, "srt/managers/communicator.py", ["FanOutCommunicator.merge_results"])
    return namespace


class ReceivingModel(torch.nn.Module):
    """The GPU model's place: `load_weights` keeps a copy of every (name, tensor) it is given."""

    def __init__(self):
        super().__init__()
        self.received: dict[str, torch.Tensor] = {}
        self.loads = 0

    def load_weights(self, named_tensors) -> None:
        self.loads += 1
        for name, tensor in named_tensors:
            self.received[name] = tensor.clone()


class TpWorker:
    """One TP rank: SGLang's scheduler-side manager over SGLang's `WeightUpdater`."""

    def __init__(self, tp_rank: int, tp_size: int, tp_port: int, dump_dir: Path):
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{tp_port}", rank=tp_rank, world_size=tp_size
        )
        self.tp_rank, self.dump_dir = tp_rank, dump_dir
        self.model = ReceivingModel()
        self.weight_version: str | None = None
        no_repacking = SimpleNamespace(
            restore_weights_before_loading=lambda model, device: None,
            postprocess_weights=lambda model, device: None,
        )
        ns = sglang_namespace(
            {
                "get_parallel": lambda: SimpleNamespace(
                    tp_group=SimpleNamespace(cpu_group=dist.group.WORLD), tp_rank=tp_rank
                ),
                "get_model": lambda: SimpleNamespace(weight_cache_mode="off"),
                "DefaultModelLoader": no_repacking,
                "post_load_weights": lambda model: None,
            }
        )
        self.ns = ns
        self.weight_updater = ns.WeightUpdater(
            tp_rank=tp_rank,
            device="cpu",
            gpu_id=0,
            model_config=None,
            custom_weight_loaders={},
            get_model=lambda: self.model,
            update_model_fields=None,
            recapture_cuda_graph=None,
            get_model_runner=None,
        )
        self.model_runner = SimpleNamespace(weight_updater=self.weight_updater)
        # SGLang's BaseTpWorker methods, which the manager calls on its tp_worker
        self.init_weights_update_group = types.MethodType(ns.init_weights_update_group, self)
        self.destroy_weights_update_group = types.MethodType(ns.destroy_weights_update_group, self)
        self.deserialize_own_rank = types.MethodType(ns.deserialize_own_rank, self)
        self.manager = ns.SchedulerWeightUpdaterManager(
            tp_worker=self,
            draft_worker=None,
            memory_saver_adapter=None,
            flush_cache=lambda empty_cache=False: True,  # no prefix cache to flush
            is_fully_idle=lambda **kw: True,
            scheduler=SimpleNamespace(record_weight_version_change=self._record_version),
        )

    def weight_update_runners(self):
        return [("target", self.model_runner)]

    def _record_version(self, new_version: str | None) -> None:
        if new_version is not None:
            self.weight_version = new_version

    def handle(self, path: str, body: dict) -> tuple[bool, str]:
        """SGLang's scheduler handling of one request; its (success, message)."""
        if path == "weight_version":
            return True, self.weight_version
        type_name, method = REQUESTS[path]
        request = pydantic.TypeAdapter(getattr(self.ns, type_name)).validate_python(body)
        answer = getattr(self.manager, method)(request)
        if method == "end_weight_update" and answer.success:
            self._dump()
        if method == "begin_weight_update" and answer.success:
            self.model.received, self.model.loads = {}, 0
        return answer.success, answer.message

    def _dump(self) -> None:
        """Write what `load_weights` got in the session, with this rank's place in the update group."""
        groups = self.weight_updater._model_update_group
        ranks = {name: group.rank() for name, group in groups.items()}  # its own rank, not the TP one
        target = self.dump_dir / f"tp{self.tp_rank}.pt"
        tmp = target.with_suffix(".tmp")
        torch.save(
            {
                "tensors": self.model.received,
                "loads": self.model.loads,
                "weight_version": self.weight_version,
                "update_group_ranks": ranks,
            },
            tmp,
        )
        os.replace(tmp, target)


def tp_worker_main(tp_rank: int, tp_size: int, tp_port: int, dump_dir: str, conn) -> None:
    """A TP rank's process: answer (path, body) requests from the HTTP process until told to stop."""
    worker = TpWorker(tp_rank, tp_size, tp_port, Path(dump_dir))
    conn.send(("ready", ""))
    while True:
        request = conn.recv()
        if request is None:
            break
        try:
            conn.send(worker.handle(*request))
        except Exception as err:  # what SGLang's FastAPI would turn into an error answer
            conn.send((False, f"{type(err).__name__}: {err}"))


class Server:
    """The HTTP side (SGLang's tokenizer manager role): validates, fans out to every TP rank, merges."""

    def __init__(self, tp_size: int, dump_dir: Path):
        self.tp_size = tp_size
        self.ns = sglang_namespace({})  # imports SGLang once: the forked TP ranks inherit it
        ctx = mp.get_context("fork")  # before any thread is started
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            tp_port = s.getsockname()[1]
        self.conns, self.procs = [], []
        for rank in range(tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=tp_worker_main, args=(rank, tp_size, tp_port, str(dump_dir), child), daemon=True
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            conn.recv()
        self.lock = threading.Lock()  # one request at a time, as SGLang's scheduler loop takes them

    def fan_out(self, path: str, body: dict) -> tuple[bool, str]:
        """Every TP rank's answer to one request, merged as SGLang merges them."""
        with self.lock:
            for conn in self.conns:
                conn.send((path, body))
            answers = [SimpleNamespace(success=s, message=m) for s, m in (c.recv() for c in self.conns)]
        return self.ns.merge_results(answers)

    def weight_version(self) -> str | None:
        """The version TP rank 0's scheduler recorded (SGLang's `/model_info` reports it)."""
        with self.lock:
            self.conns[0].send(("weight_version", {}))
            return self.conns[0].recv()[1]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(30)


def serve(server: Server, port_file: Path) -> None:
    """Answer HTTP on a free loopback port (written to `port_file`) until stdin closes."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _answer(self, status: int, payload) -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._answer(200, b"")
            elif self.path == "/get_server_info":  # launch arguments (SGLang never updates them)
                self._answer(200, {"tp_size": server.tp_size, "dp_size": 1})
            elif self.path == "/model_info":  # the live version, where SGLang reports it
                self._answer(200, {"weight_version": server.weight_version()})
            else:
                self._answer(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path == "/flush_cache":
                self._answer(200, b"Cache flushed.\n")
                return
            if self.path not in REQUESTS:
                self._answer(404, {"detail": "Not Found"})
                return
            try:  # FastAPI's validation of the body: a 422 naming the field
                pydantic.TypeAdapter(getattr(server.ns, REQUESTS[self.path][0])).validate_python(body)
            except pydantic.ValidationError as err:
                self._answer(422, {"detail": err.errors(include_url=False, include_context=False)})
                return
            success, message = server.fan_out(self.path, body)
            self._answer(200 if success else 400, {"success": success, "message": message})

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(httpd.server_address[1]))
    os.replace(tmp, port_file)
    sys.stdin.read()  # the test closes our stdin (or dies) to stop us
    httpd.shutdown()
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--dump-dir", type=Path, required=True)
    parser.add_argument("--port-file", type=Path, required=True)
    args = parser.parse_args()
    args.dump_dir.mkdir(parents=True, exist_ok=True)
    serve(Server(args.tp_size, args.dump_dir), args.port_file)


if __name__ == "__main__":
    main()
