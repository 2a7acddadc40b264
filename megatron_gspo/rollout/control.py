"""The control plane of the servers: weight-update and control calls, sent to every server.

Weight sync (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/update_weights_from_tensor``, ``/update_weights_from_disk``, the update session) and control
calls (``/pause_generation``, ``/flush_cache``, memory release, ...) go to every server at once,
never through a router (SGLang's router does not fan them out), and check SGLang's
``{"success", "message"}`` answer: a refusal raises `WeightUpdateError` with the server's message.
The calls of a distributed sync are never retried (a half-joined collective cannot be
re-entered); those the servers wait in (group init, distributed update, session start) can run in
the client's background pool (``blocking=False``), so the trainer joins the collective, or packs
its next bucket, meanwhile.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from megatron_gspo.rollout.errors import RolloutRequestError, RolloutServerError, WeightUpdateError


class ControlMixin:
    """The weight-sync and control methods of `SGLangClient`: one call to every server, all answers."""

    urls: list[str]
    health_timeout_s: float
    _http: httpx.Client
    _background: cf.Executor
    _post: Callable[..., tuple[str, httpx.Response]]
    drop_lost_workers: Callable[[dict[str, BaseException], str], dict[str, BaseException]]

    def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | int | None = None,
        *,
        flush_cache: bool = True,
        load_format: str | None = None,
        abort_all_requests: bool = False,
    ) -> list[dict[str, Any]]:
        """Make every server load the checkpoint at ``model_path`` (a path the servers can read).

        Returns:
            Each server's ``{"success": true, "message": ...}`` answer, in URL order.

        Raises:
            WeightUpdateError: a server reported ``success: false`` (its message is kept).
        """
        body = {
            "model_path": str(model_path),
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        return self._broadcast("/update_weights_from_disk", body)

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str] | Sequence[Sequence[str]],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | int | None = None,
    ) -> list[dict[str, Any]]:
        """Send tensor handles (`rollout.tensor_handles`): one base64 entry per TP rank of a server.

        Args:
            serialized_named_tensors: one list of entries for every server, or one list per server
                (in `urls` order). A CPU handle is opened by exactly one server rank (its shared
                memory is reference-counted), so with several servers give each its own entries.
            load_format: None (a list of (name, tensor) pairs) or ``"flattened_bucket"``.
            flush_cache: SGLang's flag (the trainer flushes once after the last bucket).
            weight_version: the version the servers report once this update is applied.
        """
        per_server = (
            [list(serialized_named_tensors)] * len(self.urls)
            if all(isinstance(entry, str) for entry in serialized_named_tensors)
            else [list(entries) for entries in serialized_named_tensors]
        )
        if len(per_server) != len(self.urls):
            raise ValueError(f"{len(per_server)} lists of serialized tensors for {len(self.urls)} servers")
        bodies = []
        for entries in per_server:
            body: dict[str, Any] = {"serialized_named_tensors": entries, "flush_cache": flush_cache}
            if load_format is not None:
                body["load_format"] = load_format
            if weight_version is not None:
                body["weight_version"] = str(weight_version)
            bodies.append(body)
        return self._broadcast("/update_weights_from_tensor", bodies)

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offsets: Sequence[int] | None = None,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        blocking: bool = True,
    ) -> list[dict[str, Any]] | cf.Future:
        """Make every server join a process group with the trainer (trainer rank 0).

        The servers block in the collective until the trainer joins too, so call with
        ``blocking=False`` and ``.result()`` the returned future after the trainer's own
        ``init_process_group``. Never retried (a half-joined collective cannot be re-entered).
        The first refusal is the answer: servers that joined wait in the rendezvous for ranks
        that will not come (until their own timeout), so they are not awaited.

        Args:
            master_address: the trainer's rendezvous address.
            master_port: the trainer's rendezvous port.
            world_size: 1 + the number of GPUs over all servers.
            rank_offsets: the first rank of each server's GPUs, one per URL (default: ``[1]``
                for a single server).
            group_name: the group's name, reused by the update/destroy calls.
            backend: ``"nccl"`` on GPUs.
            blocking: wait for the answers, or return a future of them.
        """
        if rank_offsets is None:
            if len(self.urls) != 1:
                raise ValueError("rank_offsets (one per server) is required with several servers")
            rank_offsets = [1]
        if len(rank_offsets) != len(self.urls):
            raise ValueError(f"{len(rank_offsets)} rank_offsets for {len(self.urls)} servers")
        bodies = [
            {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": int(offset),
                "world_size": int(world_size),
                "group_name": group_name,
                "backend": backend,
            }
            for offset in rank_offsets
        ]
        return self._maybe_background(blocking, "/init_weights_update_group", bodies, stop_at_refusal=True)

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | int | None = None,
        load_format: str | None = None,
        blocking: bool = True,
    ) -> list[dict[str, Any]] | cf.Future:
        """Announce a broadcast of named tensors over the update group (the trainer sends them).

        Like `init_weights_update_group`, the servers wait in the collective: use
        ``blocking=False``, broadcast, then ``.result()``. Never retried. ``load_format=
        "flattened_bucket"``: one broadcast of all tensors' bytes concatenated (`hf_stream.Bucket`).
        SGLang >= 0.5.23 takes it only between `begin_weight_update` and `end_weight_update`.
        """
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [[int(n) for n in s] for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        return self._maybe_background(blocking, "/update_weights_from_distributed", [body] * len(self.urls))

    def begin_weight_update(self, *, blocking: bool = True) -> list[dict[str, Any]] | cf.Future:
        """Open a weight-update session on every server (updates are loaded within it).

        ``blocking=False`` returns a future: the sender packs its first bucket meanwhile.
        """
        return self._maybe_background(blocking, "/begin_weight_update", [{}] * len(self.urls))

    def end_weight_update(
        self, *, abort: bool = False, timeout_s: float | None = None
    ) -> list[dict[str, Any]]:
        """Close every server's session.

        ``abort=True`` after a failed sync says so; SGLang ignores the field (and so does the
        embedded server): the buckets loaded stay loaded until a retry. `timeout_s` bounds the
        wait for each answer (a server still held in a broadcast answers only when it ends).
        """
        body = {"abort": True} if abort else {}
        return self._broadcast("/end_weight_update", body, retry=False, timeout_s=timeout_s)

    def server_info(self) -> list[dict[str, Any]]:
        """Every server's `/get_server_info`: its launch arguments (e.g. `tp_size`).

        `tp_size` is its ranks in a weight-update group. SGLang never updates these values: the
        weights served now are `model_info`'s.
        """
        return self._get_all("/get_server_info")

    def model_info(self) -> list[dict[str, Any]]:
        """Every server's `/model_info`: the `weight_version` and `model_path` it serves now.

        SGLang's `model_info` reports what weight updates set; `/get_server_info` does not.
        """
        return self._get_all("/model_info")

    def _get_all(self, path: str) -> list[dict[str, Any]]:
        """Every server's JSON answer to GET `path`, in `urls` order."""
        answers = []
        for url in self.urls:
            try:
                response = self._http.get(f"{url}{path}", timeout=self.health_timeout_s)
                response.raise_for_status()
                answers.append(response.json())
            except (httpx.HTTPError, ValueError) as err:
                raise RolloutServerError(
                    url=url, path=path, attempts=1, last_error=f"{type(err).__name__}: {err}"
                ) from None
        return answers

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> list[dict[str, Any]]:
        """Make every server leave the update group."""
        return self._broadcast("/destroy_weights_update_group", {"group_name": group_name}, retry=False)

    paused_in_place = False
    """Between `pause_generation("in_place")` and `continue_generation`: the servers hold their
    running requests, so SGLang refuses `/flush_cache` until generation continues."""

    def pause_generation(self, mode: str | None = None) -> list[dict[str, Any]]:
        """Pause scheduling on every server (``mode``: SGLang's ``abort``/``retract``/``in_place``).

        Behind a router a worker that cannot be reached is dropped from the fleet
        (`drop_lost_workers`), the others stay paused; the answers are the others'.
        """
        self.paused_in_place = mode == "in_place"
        body = {} if mode is None else {"mode": mode}
        return self._broadcast("/pause_generation", body, expect_success=False, drop_lost=True)

    def continue_generation(self) -> list[dict[str, Any]]:
        """Resume scheduling on every server (behind a router, a lost worker is dropped, as in a pause)."""
        self.paused_in_place = False
        return self._broadcast("/continue_generation", {}, expect_success=False, drop_lost=True)

    def flush_cache(self) -> list[dict[str, Any]]:
        """Flush every server's prefix cache (SGLang answers 400 while requests are running).

        Behind a router a lost worker is dropped, as in a pause: the others' weights are in place.
        """
        return self._broadcast("/flush_cache", {}, expect_success=False, drop_lost=True)

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Free GPU memory (``tags``: ``weights``, ``kv_cache``); needs ``--enable-memory-saver``."""
        body = {} if tags is None else {"tags": list(tags)}
        return self._broadcast("/release_memory_occupation", body, expect_success=False)

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Re-allocate what `release_memory_occupation` freed."""
        body = {} if tags is None else {"tags": list(tags)}
        return self._broadcast("/resume_memory_occupation", body, expect_success=False)

    def _maybe_background(
        self, blocking: bool, path: str, bodies: list[dict[str, Any]], *, stop_at_refusal: bool = False
    ):
        call = functools.partial(self._broadcast, path, bodies, retry=False, stop_at_refusal=stop_at_refusal)
        return call() if blocking else self._background.submit(call)

    def _broadcast(
        self,
        path: str,
        body: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        retry: bool = True,
        expect_success: bool = True,
        timeout_s: float | None = None,
        drop_lost: bool = False,
        stop_at_refusal: bool = False,
    ) -> list[dict[str, Any]]:
        """POST to every server at once (one body for all, or one per server); all answers or an error.

        `drop_lost`: an unreachable server is handed to `drop_lost_workers` (behind a router it
        leaves the fleet and its failure is not raised). `stop_at_refusal`: the first failure
        is raised without waiting for the other servers (a collective one refused cannot
        complete; their calls end on daemon threads, by their own timeouts).
        """
        urls = list(self.urls)
        bodies = [body] * len(urls) if isinstance(body, Mapping) else list(body)
        call = functools.partial(
            self._control_call,
            retry=retry and not drop_lost,  # a dead worker is known at once; a live one is retried below
            expect_success=expect_success,
            timeout_s=timeout_s,
        )
        if not urls:  # a fleet emptied by removals (its FleetTooSmallError is on its way up)
            return []
        if len(urls) == 1:  # no thread to start for one server
            futures = [_done(call, urls[0], path, bodies[0])]
        else:
            futures = [_in_thread(call, url, path, b) for url, b in zip(urls, bodies)]
            cf.wait(futures, return_when=cf.FIRST_EXCEPTION if stop_at_refusal else cf.ALL_COMPLETED)
        pending = sum(not f.done() for f in futures)
        failures = [
            (url, f.exception()) for url, f in zip(urls, futures) if f.done() and f.exception() is not None
        ]
        if drop_lost and failures:
            unreachable = {u: e for u, e in failures if isinstance(e, RolloutServerError)}
            alive = self.drop_lost_workers(unreachable, path) if unreachable else {}
            again = functools.partial(call, retry=retry)
            futures = [
                _done(again, u, path, b) if u in alive else f for u, b, f in zip(urls, bodies, futures)
            ]
            failures = [(u, f.exception()) for u, f in zip(urls, futures) if f.exception() is not None]
            failures = [(u, e) for u, e in failures if u not in unreachable or u in alive]
            futures = [f for u, f in zip(urls, futures) if u in self.urls]
        if not failures:
            return [f.result() for f in futures]
        url, first = failures[0]
        if len(urls) > 1 and isinstance(first, WeightUpdateError):
            failed = f"{len(failures)} of {len(urls)} failed: " + ", ".join(u for u, _ in failures)
            if pending:
                failed += f"; {pending} other(s) not awaited"
            raise WeightUpdateError(
                url=url,
                path=path,
                server_message=f"{first.server_message} ({failed})",
            ) from first
        raise first

    def _control_call(
        self,
        url: str,
        path: str,
        body: Mapping[str, Any],
        *,
        retry: bool,
        expect_success: bool,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        try:
            _, response = self._post(path, body, url=url, retry=retry, timeout_s=timeout_s)
        except RolloutRequestError as err:  # SGLang answers a failed update with 400 + success=false
            raise WeightUpdateError(url=url, path=path, server_message=err.server_message) from None
        try:
            answer = response.json()
        except ValueError:
            answer = {"message": response.text}  # /flush_cache answers plain text
        if not isinstance(answer, dict):
            answer = {"message": answer}
        if expect_success and answer.get("success") is not True:
            raise WeightUpdateError(
                url=url,
                path=path,
                server_message=str(answer.get("message", f"no success field in {answer!r}")),
            )
        return answer


def _in_thread(call: Callable[..., Any], *args: Any) -> cf.Future:
    """`call(*args)` on a daemon thread, as a future: one left running does not hold up an exit."""
    future: cf.Future = cf.Future()
    threading.Thread(
        target=_run_into, args=(future, call, *args), name="sglang-broadcast", daemon=True
    ).start()
    return future


def _run_into(future: cf.Future, call: Callable[..., Any], *args: Any) -> None:
    try:
        future.set_result(call(*args))
    except Exception as err:  # noqa: BLE001 - handed over like a pool's future
        future.set_exception(err)


def _done(call: Callable[..., Any], *args: Any) -> cf.Future:
    """`call(*args)` run here, as a finished future (its result or its exception)."""
    future: cf.Future = cf.Future()
    _run_into(future, call, *args)
    return future
