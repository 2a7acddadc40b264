"""HTTP client for one or many SGLang servers (real SGLang on GPU nodes, the embedded server on CPU).

Generation fans a batch of ``/generate`` requests out over the servers with a bounded number in
flight (a thread pool over one shared ``httpx.Client``), sending each request to the server with
the fewest requests in flight (round-robin among ties). Connection errors, timeouts and 5xx/429
answers are retried with exponential backoff (tenacity), moving to another server when there is
one; a 4xx is the request's fault and raises at once with the server's message. A batch either
returns every response, in request order, or raises: when one request fails for good the rest
are cancelled and awaited, so no request of a failed batch is still running when the error
surfaces (a following weight update cannot race it).

Time bounds. One attempt waits at most `connect_timeout_s` to connect and `timeout_s` for each
read (a server that keeps trickling bytes is not cut off), so one request takes at most about
``timeout_s x (max_retries + 1) + backoff`` with backoff = ``sum(min(backoff_s x 2^k,
max_backoff_s) for k < max_retries)``. `batch_timeout_s` caps a whole `generate` /
`generate_batched` call: past it the call raises `RolloutBatchTimeoutError` naming the servers
still working, after cancelling queued requests, stopping retries and asking those servers to
abort the in-flight ones by `rid` (their threads end when the servers answer, at the latest
after the per-request bound).

Weight-sync and control calls (``/update_weights_from_disk``, ``/pause_generation``, ...) go to
every server and check SGLang's ``{"success", "message"}`` answer (`control.ControlMixin`).

Behind SGLang's router (`router_url`), the servers are the workers the router lists
(`fleet.RouterWorkers`): generation goes through the router, one request per row (it routes
each, cache-aware, and retries elsewhere when a worker fails), while control calls, weight
sync and version checks still go to every worker.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import tenacity

from megatron_gspo.rollout.control import ControlMixin
from megatron_gspo.rollout.errors import (
    GenerationCancelledError,
    MalformedResponseError,
    RolloutBatchTimeoutError,
    RolloutRequestError,
    RolloutServerError,
)
from megatron_gspo.rollout.fleet import FleetMixin

_RETRYABLE_4XX = (408, 429)  # timeouts and back-pressure are transient, unlike other 4xx


class _TransientError(Exception):
    """One attempt failed in a way worth retrying (connection, timeout, 5xx)."""

    def __init__(self, url: str, description: str):
        super().__init__(description)
        self.url = url
        self.description = description


class _NotSent(Exception):
    """A job of a batch that had already failed: it was never sent."""


class _Batch:
    """One `generate`/`generate_batched` call: its stop signal, and which server each job is on."""

    def __init__(self, rids: list[list[str | None]], on_failed: Callable[[], None] | None = None):
        self.rids = rids  # per job, the request ids of its rows
        self.failed = threading.Event()
        self.servers: dict[int, str] = {}  # job -> server of its attempt in flight
        self.cancelled: cf.Future = cf.Future()
        """Done once every job is (result None), or at `cancel_generation` (its exception): one wait
        covers both."""
        self._on_failed = on_failed
        self._lock = threading.Lock()

    def fail(self) -> None:
        """Stop the batch (once): wake backoff sleeps, stop retries, send no queued job."""
        with self._lock:
            if self.failed.is_set():
                return
            self.failed.set()
        if self._on_failed is not None:
            self._on_failed()

    def start(self, pool: cf.Executor, send: Callable[..., Any], jobs: Sequence) -> list[cf.Future]:
        """Submit `send(job, self, index)` for each job; the futures in job order."""
        futures = [pool.submit(self._run, send, job, index) for index, job in enumerate(jobs)]
        left = [len(futures)]

        def one_done(_: cf.Future) -> None:
            with self._lock:
                left[0] -= 1
                if left[0] or self.cancelled.done():
                    return
                self.cancelled.set_result(None)

        for future in futures:
            future.add_done_callback(one_done)
        return futures

    def cancel(self) -> None:
        """End the call waiting on this batch with `GenerationCancelledError` (unless it is done)."""
        with self._lock:
            if not self.cancelled.done():
                self.cancelled.set_exception(GenerationCancelledError("rollout generation cancelled"))

    @property
    def was_cancelled(self) -> bool:
        return self.cancelled.done() and self.cancelled.exception() is not None

    def _run(self, send: Callable[..., Any], job: Any, index: int) -> Any:
        """Run one job unless the batch has failed; a job failing for good stops the batch at once.

        So a failure stops the queued jobs in the thread that saw it, without waiting for the
        caller's thread to wake up and cancel them.
        """
        if self.failed.is_set():
            raise _NotSent
        try:
            return send(job, self, index)
        except Exception:
            self.fail()
            raise

    def in_flight(self, jobs: list[int]) -> dict[str, list[str]]:
        """Server -> request ids (where known) of those of `jobs` that are on a server now."""
        out: dict[str, list[str]] = {}
        for job in jobs:
            url = self.servers.get(job)
            if url is not None:
                out.setdefault(url, []).extend(r for r in self.rids[job] if r is not None)
        return out


class SGLangClient(ControlMixin, FleetMixin):
    """Talks to one or many SGLang servers over HTTP.

    The weight-sync and control methods are `control.ControlMixin`'s, the fleet methods
    `fleet.FleetMixin`'s.

    Args:
        urls: server base URLs, e.g. ``["http://10.0.0.1:30000"]``.
        max_concurrency: most ``/generate`` requests in flight at once, over all servers.
        timeout_s: read/write timeout of one HTTP attempt (a long generation must fit in it).
        connect_timeout_s: connect timeout of one HTTP attempt.
        max_retries: retries after the first attempt (so ``max_retries + 1`` attempts at most).
        backoff_s: first backoff; it doubles after each failed attempt.
        max_backoff_s: backoff ceiling.
        health_timeout_s: timeout of one ``/health`` probe (SGLang's runs a 1-token generation and
            answers 503 after its own 20 s timeout) or ``/model_info`` liveness probe.
        trust_env: honour proxy environment variables (off: cluster proxies rarely reach servers).
        batch_timeout_s: most seconds one `generate` / `generate_batched` call may take (None: no cap).
        router_url: SGLang's router: generation goes through it and the servers are the workers
            it lists (`urls` must then be empty).
        min_workers: fewest workers a router's fleet may shrink to (`remove_unhealthy_workers`).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        max_concurrency: int = 64,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        health_timeout_s: float = 30.0,
        trust_env: bool = False,
        batch_timeout_s: float | None = None,
        router_url: str | None = None,
        min_workers: int = 1,
    ):
        if isinstance(urls, str):
            urls = [urls]
        if router_url is not None and urls:
            raise ValueError("give server URLs or a router_url, not both: the router lists its workers")
        if not urls and router_url is None:
            raise ValueError("at least one server URL is needed")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if batch_timeout_s is not None and not batch_timeout_s > 0:
            raise ValueError(f"batch_timeout_s must be > 0 (or None), got {batch_timeout_s}")
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"duplicate server URLs: {self.urls}")
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.health_timeout_s = health_timeout_s
        self.batch_timeout_s = batch_timeout_s
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            # Room for control calls beside a full load of /generate (a router's workers are listed later).
            limits=httpx.Limits(max_connections=max_concurrency + (2 * len(self.urls) if self.urls else 128)),
            trust_env=trust_env,
        )
        self._pool = cf.ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="sglang-generate")
        self._background = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="sglang-control")
        self._lock = threading.Lock()
        self._batches: set[_Batch] = set()  # the generate calls under way (`cancel_generation`)
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._turn = itertools.count()
        self._init_fleet(router_url, min_workers)
        if self.router is not None:
            self._in_flight = {self.router.url: 0}
            with contextlib.suppress(RolloutServerError):  # a router still starting: `wait_until_healthy`
                self.refresh_workers()

    on_batch_failed: Callable[[], None] | None = None
    """Called once when a `generate` / `generate_batched` call fails (a request failed for good or
    the batch timed out), from the thread that saw it, before any queued request is dropped."""

    # ---- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker threads and close connections."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._background.shutdown(wait=True, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> SGLangClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- generation ------------------------------------------------------------------------

    def generate(self, requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Send ``/generate`` requests concurrently; all responses in request order, or an error.

        Args:
            requests: bodies, e.g. from `build_generate_request` (one prompt each).

        Returns:
            The parsed JSON response of each request (validate with `parse_generate_response`).

        Raises:
            RolloutServerError: a request failed through every retry.
            RolloutRequestError: a server rejected a request (4xx), with its message.
            MalformedResponseError: a server answered 2xx with something other than a JSON object.
            RolloutBatchTimeoutError: the call took longer than `batch_timeout_s`.
        """
        if not requests:
            return []
        batch = _Batch([[body.get("rid")] for body in requests], self.on_batch_failed)
        futures = batch.start(self._pool, self._generate_one, requests)
        self._wait_batch(futures, batch)
        return [f.result() for f in futures]

    def generate_batched(self, requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Send one-prompt bodies as one SGLang batch request per server; responses in request order.

        SGLang takes `input_ids` as a list of lists with per-row `sampling_params` and `rid` and
        answers a JSON list, which batches far better than many concurrent single requests.
        The shared flags (`return_logprob`, routed experts) come from the first body.

        Raises:
            MalformedResponseError: a server did not answer one response object per row.
            RolloutServerError, RolloutRequestError, RolloutBatchTimeoutError: as `generate`.
        """
        if not requests:
            return []
        if self.router is not None:  # the router takes one sampling_params per request, and routes each row
            return self.generate(requests)
        n_chunks = min(len(self.urls), len(requests))
        bounds = [len(requests) * i // n_chunks for i in range(n_chunks + 1)]
        chunks = [list(requests[a:b]) for a, b in zip(bounds, bounds[1:])]
        batch = _Batch([[row.get("rid") for row in chunk] for chunk in chunks], self.on_batch_failed)
        futures = batch.start(self._pool, self._generate_rows, chunks)
        self._wait_batch(futures, batch)
        return [response for f in futures for response in f.result()]

    def cancel_generation(self) -> None:
        """End every `generate` call under way with `GenerationCancelledError` (a run stopping).

        Their requests in flight are aborted on the servers, and the calls wait only a short
        while (`health_timeout_s`) for them to come back. Later calls are not affected.
        """
        with self._lock:
            batches = list(self._batches)
        for batch in batches:
            batch.cancel()

    def _wait_batch(self, futures: list[cf.Future], batch: _Batch) -> None:
        """Return when every job succeeded; else stop the batch and raise its first error or a timeout."""
        deadline = None if self.batch_timeout_s is None else time.monotonic() + self.batch_timeout_s

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        with self._lock:
            self._batches.add(batch)
        try:
            done, pending = cf.wait(
                [*futures, batch.cancelled], timeout=left(), return_when=cf.FIRST_EXCEPTION
            )
        finally:
            with self._lock:
                self._batches.discard(batch)
        errors = [f for f in futures if f in done and f.exception() is not None and not _not_sent(f)]
        pending.discard(batch.cancelled)
        if not errors and not pending and not batch.was_cancelled:
            return
        batch.fail()  # wakes backoff sleeps and stops further retries of this batch
        for f in futures:
            f.cancel()
        if batch.was_cancelled:  # the run is stopping: abort what is out now, wait briefly
            running = {f for f in futures if not f.done()}
            self._abort_in_flight(batch, futures, running)
            cf.wait(futures, timeout=self.health_timeout_s)
            raise batch.cancelled.exception()
        # Nothing of a failed batch may still be running when we raise, within the time cap.
        _, running = cf.wait(futures, timeout=left())
        if errors and not running:
            raise errors[0].exception()
        in_flight = self._abort_in_flight(batch, futures, running)
        jobs = {f: job for job, f in enumerate(futures)}
        unfinished = [job for f, job in jobs.items() if not f.done() or f.cancelled() or _not_sent(f)]
        raise RolloutBatchTimeoutError(
            timeout_s=self.batch_timeout_s,
            pending_urls=sorted(in_flight),
            pending=sum(len(batch.rids[job]) for job in unfinished),
            total=sum(len(r) for r in batch.rids),
        ) from (errors[0].exception() if errors else None)

    def _abort_in_flight(self, batch: _Batch, futures: list[cf.Future], running) -> dict[str, list[str]]:
        """Ask the servers to abort the requests of `running` jobs; server -> those request ids."""
        jobs = {f: job for job, f in enumerate(futures)}
        in_flight = batch.in_flight([jobs[f] for f in running])
        for url, rids in in_flight.items():
            for target in self.urls if self.router is not None else [url]:  # the router does not route aborts
                self._background.submit(self._abort, target, rids)
        return in_flight

    def _abort(self, url: str, rids: list[str]) -> None:
        """Best effort: ask `url` to abort requests `rids` (SGLang answers them at once, finish `abort`)."""
        for rid in rids:
            try:
                self._http.post(f"{url}/abort_request", json={"rid": rid}, timeout=self.health_timeout_s)
            except httpx.HTTPError:
                return  # the server is unreachable: nothing to abort there

    def _generate_rows(self, rows: list[Mapping[str, Any]], batch: _Batch, job: int) -> list[dict[str, Any]]:
        merged: dict[str, Any] = {
            "input_ids": [row["input_ids"] for row in rows],
            "sampling_params": [row.get("sampling_params", {}) for row in rows],
            "return_logprob": rows[0].get("return_logprob", False),
            "stream": False,
        }
        if all("rid" in row for row in rows):
            merged["rid"] = [row["rid"] for row in rows]
        for key in ("return_routed_experts", "routed_experts_start_len", "logprob_start_len"):
            if key in rows[0]:
                merged[key] = rows[0][key]
        url, response = self._post("/generate", merged, batch=batch, job=job)
        try:
            answer = response.json()
        except ValueError as err:
            raise MalformedResponseError("response", f"{url}/generate answered non-JSON ({err})") from None
        if (
            not isinstance(answer, list)
            or len(answer) != len(rows)
            or not all(isinstance(a, dict) for a in answer)
        ):
            got = f"{len(answer)} items" if isinstance(answer, list) else type(answer).__name__
            raise MalformedResponseError(
                "response",
                f"{url}/generate answered {got} for a batch of {len(rows)} rows, expected a list of objects",
            )
        return answer

    def _generate_one(self, body: Mapping[str, Any], batch: _Batch, job: int) -> dict[str, Any]:
        url, response = self._post("/generate", body, batch=batch, job=job)
        try:
            parsed = response.json()
        except ValueError as err:
            raise MalformedResponseError(
                "response", f"{url}/generate answered HTTP {response.status_code} with non-JSON ({err})"
            ) from None
        if not isinstance(parsed, dict):
            raise MalformedResponseError(
                "response", f"{url}/generate answered a JSON {type(parsed).__name__}, expected an object"
            )
        return parsed

    # ---- one HTTP call with retries -----------------------------------------------------------

    def _post(
        self,
        path: str,
        body: Mapping[str, Any],
        *,
        url: str | None = None,
        retry: bool = True,
        batch: _Batch | None = None,
        job: int = 0,
        timeout_s: float | None = None,
    ) -> tuple[str, httpx.Response]:
        """POST with bounded retries; the server used and its 2xx response.

        With `batch`, the attempt's server is recorded as job `job`'s and the batch's failure
        stops further retries. `timeout_s` replaces the client's read timeout for this call.
        """
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        cancelled = batch.failed if batch is not None else None
        attempts = 0
        tried: list[str] = []
        last: list[str | None] = [None]

        def attempt() -> tuple[str, httpx.Response]:
            nonlocal attempts
            attempts += 1
            target = url or self._acquire(avoid=last[0])
            if url is not None:
                self._hold(target)
            if target not in tried:
                tried.append(target)
            last[0] = target
            if batch is not None:
                batch.servers[job] = target
            try:
                response = self._http.post(f"{target}{path}", json=dict(body), timeout=timeout)
            except httpx.HTTPError as err:
                raise _TransientError(target, f"{type(err).__name__}: {err or 'no detail'}") from err
            finally:
                self._release(target)
                if batch is not None:
                    batch.servers.pop(job, None)
            if response.status_code >= 500 or response.status_code in _RETRYABLE_4XX:
                raise _TransientError(target, f"HTTP {response.status_code}: {_server_message(response)}")
            if response.status_code >= 400:
                raise RolloutRequestError(
                    url=target,
                    path=path,
                    status_code=response.status_code,
                    server_message=_server_message(response),
                )
            return target, response

        stop = tenacity.stop_after_attempt((self.max_retries if retry else 0) + 1)
        if cancelled is not None:
            stop = stop | tenacity.stop_when_event_set(cancelled)
        retrying = tenacity.Retrying(
            stop=stop,
            wait=tenacity.wait_exponential(multiplier=self.backoff_s, max=self.max_backoff_s),
            retry=tenacity.retry_if_exception_type(_TransientError),
            sleep=cancelled.wait if cancelled is not None else time.sleep,
            reraise=True,
        )
        try:
            return retrying(attempt)
        except _TransientError as err:
            raise RolloutServerError(
                url=err.url, path=path, attempts=attempts, last_error=err.description, urls=tried
            ) from None

    def _acquire(self, avoid: str | None) -> str:
        """The server with the fewest requests in flight (round-robin among ties), counted in."""
        with self._lock:
            start = next(self._turn)
            targets = [self.router.url] if self.router is not None else self.urls
            order = [targets[(start + i) % len(targets)] for i in range(len(targets))]
            if avoid is not None and len(order) > 1:
                order.remove(avoid)  # after a failure, try another server first
            target = min(order, key=lambda u: self._in_flight[u])
            self._in_flight[target] += 1
            return target

    def _hold(self, url: str) -> None:
        with self._lock:
            self._in_flight[url] = self._in_flight.get(url, 0) + 1

    def _release(self, url: str) -> None:
        with self._lock:
            self._in_flight[url] -= 1


def _not_sent(future: cf.Future) -> bool:
    """Whether a finished job was dropped because its batch had already failed."""
    return not future.cancelled() and isinstance(future.exception(), _NotSent)


def _server_message(response: httpx.Response) -> str:
    """The server's explanation: ``error.message``/``message``/``detail`` of a JSON body, else the text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:2000] or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])
        if error is not None:
            return str(error)
    return str(body)[:2000]
