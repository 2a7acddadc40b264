"""A fleet of rollout workers found through SGLang's router (pip `sglang-router`).

The router fronts generation (cache-aware placement, retries, circuit breaking); it does not
fan out control calls or weight updates, so the client sends those to every worker the router
lists at ``GET /workers`` (as slime does). A worker that stops answering is removed from the
router (``DELETE /workers/{id}``) so no generation is routed to it, and from the client's list,
so the next weight-update group is built without it (a worker is probed with
``GET /model_info``, which SGLang answers paused or not, never with its generating ``/health``);
below `min_workers` the run stops with `FleetTooSmallError`. A removed worker that answers
again is synced with the others and only then added back to the router (``POST /workers``), so
it never serves an older version.

A worker lost in the middle of a distributed sync's broadcast can leave others waiting in that
collective: SGLang gives no way to abort a receive (no timeout field in
``/init_weights_update_group``; its group uses torch's 30 min default; ``/destroy_weights_update_group``
is served only after the receive ends), and nothing the sender does to its own side frees them.
So a worker that does not answer ``/destroy_weights_update_group`` within a bounded wait (the
sync's `release_timeout_s`) is *held*: it is set aside like a lost one (its weights may be
half-updated: SGLang loads each bucket as it arrives) and comes back once it answers the
session's end and the group's destruction, i.e. once its own collective timed out.

A worker lost while the fleet pauses or continues generation (`rollout.update_mode` pause /
partial) is dropped the same way (`drop_lost_workers`), so the others are still paused, synced
and continued; the size check is the sync's. A worker left paused (by a run killed mid-sync)
answers SGLang's ``GET /ready`` with 503: start-up continues it (`continue_paused_workers`).
Every removal and readmission is logged with its reason.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass

import httpx

from megatron_gspo.rollout.errors import RolloutFault, RolloutServerError

logger = logging.getLogger(__name__)
REMOVAL_WAIT_S = 10.0
"""How long a removal may take to show in the router's list (it is queued there)."""
HELD_PROBE_S = 5.0
"""Longest wait for a held worker's answer before each sync: one out of its collective answers a
control call between two forward batches."""


class FleetTooSmallError(RolloutFault):
    """Fewer healthy workers remain than `rollout.min_workers`; the message names the lost ones."""


@dataclass
class FleetStats:
    """`fleet/*` counters of the run so far."""

    workers: int = 0
    removed: int = 0
    rejoined: int = 0

    def metrics(self) -> dict[str, float]:
        """`fleet/workers` (now), `fleet/removed` and `fleet/rejoined` (since the start)."""
        return {
            "fleet/workers": float(self.workers),
            "fleet/removed": float(self.removed),
            "fleet/rejoined": float(self.rejoined),
        }


class RouterWorkers:
    """The worker list of the router at `url`, read and edited over its HTTP API.

    Args:
        url: the router's base URL.
        http: the client's connection pool.
        timeout_s: timeout of one call.
    """

    def __init__(self, url: str, http: httpx.Client, timeout_s: float):
        self.url = url.rstrip("/")
        self._http = http
        self._timeout_s = timeout_s

    def list(self) -> dict[str, str]:
        """Worker URL -> the router's worker id, for every regular worker it lists.

        Raises:
            RolloutServerError: the router did not answer with its worker list.
        """
        try:
            response = self._http.get(f"{self.url}/workers", timeout=self._timeout_s)
            response.raise_for_status()
            workers = response.json()["workers"]
            return {
                str(w["url"]).rstrip("/"): str(w["id"])
                for w in workers
                if w.get("worker_type", "regular") == "regular"
            }
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
            raise RolloutServerError(
                url=self.url, path="/workers", attempts=1, last_error=f"{type(err).__name__}: {err}"
            ) from None

    def add(self, worker_url: str) -> None:
        """Put `worker_url` (back) into the router's rotation and wait until it is listed healthy."""
        self._http.post(
            f"{self.url}/workers", json={"url": worker_url}, timeout=self._timeout_s
        ).raise_for_status()
        deadline = time.monotonic() + REMOVAL_WAIT_S
        while worker_url.rstrip("/") not in self.list() and time.monotonic() < deadline:
            time.sleep(0.1)

    def remove(self, worker_url: str) -> None:
        """Take `worker_url` out of the router's rotation and wait until it is no longer listed."""
        worker_id = self.list().get(worker_url.rstrip("/"))
        if worker_id is None:
            return
        self._http.delete(f"{self.url}/workers/{worker_id}", timeout=self._timeout_s).raise_for_status()
        deadline = time.monotonic() + REMOVAL_WAIT_S
        while worker_url.rstrip("/") in self.list() and time.monotonic() < deadline:
            time.sleep(0.1)


class FleetMixin:
    """The fleet methods of `SGLangClient`: its workers' health and, behind a router, who they are.

    Behind a router the workers are found at the router, removed when lost or held, and rejoin
    once synced; without one the configured servers are the fleet and none is ever removed.
    """

    urls: list[str]
    router: RouterWorkers | None
    min_workers: int
    fleet: FleetStats
    health_timeout_s: float
    _http: httpx.Client

    def _init_fleet(self, router_url: str | None, min_workers: int) -> None:
        self.min_workers = min_workers
        self._unreported: dict[str, str] = {}
        """Workers dropped outside a sync (pause, continue) -> why: named by the next size check."""
        self._removed: dict[str, str | None] = {}
        """Workers out of the router -> the group they are held in (None: lost); probed before a sync."""
        self.fleet = FleetStats(workers=len(self.urls))
        self.router = None
        if router_url is not None:
            self.router = RouterWorkers(router_url, self._http, self.health_timeout_s)

    def health(self) -> dict[str, bool]:
        """``{url: healthy}`` from one ``GET /health`` per server."""
        return {url: self._health_problem(url) is None for url in self.urls}

    def wait_until_healthy(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> None:
        """Block until every server answers ``/health`` with 200 (a paused one is continued first).

        Raises:
            RolloutServerError: some server is still unhealthy after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while self.router is not None:  # first the router, until it lists a worker
            try:
                if self.refresh_workers():
                    break
                problem = "the router lists no worker"
            except RolloutServerError as err:
                problem = err.last_error
            if time.monotonic() + poll_s > deadline:
                raise RolloutServerError(
                    url=self.router.url,
                    path="/workers",
                    attempts=1,
                    last_error=f"{problem} (waited {timeout_s:.1f}s)",
                )
            time.sleep(poll_s)
        self.continue_paused_workers()  # else its /health waits out the pause: 503, retried to the deadline
        pending = list(self.urls)
        problems: dict[str, str] = {}
        polls = 0
        while True:
            polls += 1
            problems = {url: p for url in pending if (p := self._health_problem(url)) is not None}
            pending = list(problems)
            if not pending:
                return
            if time.monotonic() + poll_s > deadline:
                break
            time.sleep(poll_s)
        url = pending[0]
        raise RolloutServerError(
            url=url,
            path="/health",
            attempts=polls,
            last_error=f"{problems[url]} (waited {timeout_s:.1f}s)",
            urls=pending,
        )

    def refresh_workers(self) -> list[str]:
        """Re-read the router's worker list into `urls` (unchanged without a router)."""
        if self.router is not None:
            self.urls = sorted(self.router.list())
            self.fleet.workers = len(self.urls)
        return self.urls

    def remove_unhealthy_workers(self) -> list[str]:
        """Remove every worker that does not answer ``/model_info`` from the router and `urls`.

        Not ``/health``: the sync that calls this may run with the workers paused, and SGLang's
        /health then answers 503 after its 20 s timeout (see `_liveness_problem`). Workers removed
        earlier that are back (answering, and out of the collective they were held in) are put
        back in `urls` (not in the router: `readmit_workers` does that after they were synced).

        Returns:
            The workers removed.

        Raises:
            FleetTooSmallError: fewer than `min_workers` remain (the removals are done).
        """
        if self.router is None:
            return []
        self.refresh_workers()
        dead = {url: p for url in self.urls if (p := self._liveness_problem(url)) is not None}
        for url, problem in dead.items():
            self._remove(url, f"/model_info: {problem}")
        back = [url for url, group in self._removed.items() if self._back_problem(url, group) is None]
        self._removed = {u: g for u, g in self._removed.items() if u not in back} | dict.fromkeys(dead)
        self.urls = sorted((set(self.urls) - set(dead)) | set(back))
        self.fleet.workers = len(self.urls)
        self.fleet.removed += len(dead)
        self._check_size(dead)
        return list(dead)

    def set_aside_held_workers(self, group_name: str, timeout_s: float) -> list[str]:
        """After a failed sync: workers that do not leave `group_name` within `timeout_s` are set aside.

        Each worker is asked to leave the group (``/destroy_weights_update_group``); one still
        held in the group's broadcast answers only when that ends, so past `timeout_s` it is
        removed from the router and from `urls`, and probed before each sync like a lost worker.

        Returns:
            The workers set aside.

        Raises:
            FleetTooSmallError: fewer than `min_workers` remain (the removals are done).
        """

        def leave(url: str) -> httpx.HTTPError | None:
            body = {"group_name": group_name}
            return self._post_error(url, "/destroy_weights_update_group", body, timeout_s)

        with cf.ThreadPoolExecutor(max(1, len(self.urls)), thread_name_prefix="fleet-release") as pool:
            errors = list(pool.map(leave, self.urls))
        held = {
            url: f"held in {group_name} past {timeout_s:g} s"
            for url, error in zip(self.urls, errors)
            if isinstance(error, httpx.TimeoutException)  # an unreachable one is lost: /health tells
        }
        if self.router is None:
            return []
        for url, problem in held.items():
            self._remove(url, problem)
        self._removed |= dict.fromkeys(held, group_name)
        self.urls = [url for url in self.urls if url not in held]
        self.fleet.workers = len(self.urls)
        self.fleet.removed += len(held)
        self._check_size(held)
        return list(held)

    def readmit_workers(self) -> list[str]:
        """Add the workers in `urls` that the router does not list (synced ones coming back) to it."""
        if self.router is None:
            return []
        missing = [url for url in self.urls if url not in self.router.list()]
        for url in missing:
            self.router.add(url)
            logger.info("rollout worker %s readmitted to the router: synced to the current weights", url)
        self.fleet.rejoined += len(missing)
        return missing

    def drop_lost_workers(self, failed: dict[str, BaseException], path: str) -> dict[str, BaseException]:
        """Behind a router: remove the workers of `failed` that no longer answer; the failures left.

        For control calls sent to the whole fleet (pause, continue): a worker that failed one and
        does not answer ``/model_info`` is lost, removed as `remove_unhealthy_workers` does (the
        fleet's size is checked by the next sync, on every rank). Without a router nothing is
        removed: every failure is left.
        """
        if self.router is None:
            return failed
        lost = {url: err for url, err in failed.items() if self._liveness_problem(url) is not None}
        for url, err in lost.items():
            self._remove(url, f"{path}: {err}")
            self._unreported[url] = f"{path}: {err}"
        self._removed |= dict.fromkeys(lost)
        self.urls = [url for url in self.urls if url not in lost]
        self.fleet.workers = len(self.urls)
        self.fleet.removed += len(lost)
        return {url: err for url, err in failed.items() if url not in lost}

    def continue_paused_workers(self) -> list[str]:
        """Continue every server that says it is paused (SGLang's ``GET /ready``: 503); those continued.

        A run stopped between pausing the fleet and continuing it (killed mid-sync) leaves its
        servers paused: every request would wait there until `rollout.batch_timeout_s`. A
        server without ``/ready`` (404) or not answering is left to the health wait.
        """
        paused = []
        for url in self.urls:
            try:
                ready = self._http.get(f"{url}/ready", timeout=self.health_timeout_s).status_code
                if ready != 503 or self._liveness_problem(url) is not None:
                    continue  # ready, without /ready, or still starting
                self._http.post(f"{url}/continue_generation", json={}, timeout=self.health_timeout_s)
            except httpx.HTTPError:
                continue
            logger.warning("start-up: rollout server %s was paused (GET /ready: 503): continued it", url)
            paused.append(url)
        return paused

    def _remove(self, url: str, reason: str) -> None:
        """Take `url` out of the router's rotation (the caller updates `urls`), saying why."""
        self.router.remove(url)
        logger.warning("rollout worker %s removed from the fleet: %s", url, reason)

    def _check_size(self, lost: dict[str, str]) -> None:
        lost, self._unreported = {**self._unreported, **lost}, {}
        if len(self.urls) < self.min_workers:
            names = "; ".join(f"{u}: {p}" for u, p in lost.items()) or "none this time"
            held = sorted(url for url, group in self._removed.items() if group is not None)
            raise FleetTooSmallError(
                f"{len(self.urls)} healthy rollout worker(s) left behind {self.router.url}, "
                f"rollout.min_workers={self.min_workers} (lost: {names}"
                + (f"; held in a broadcast: {', '.join(held)})" if held else ")")
            )

    def _back_problem(self, url: str, group: str | None) -> str | None:
        """Why a removed worker cannot rejoin yet (None: it can).

        A held one must also close its session and leave its group: both are answered only once
        its collective is over (whether it accepts them does not matter).
        """
        if (problem := self._liveness_problem(url)) is not None or group is None:
            return problem
        leave = ("/destroy_weights_update_group", {"group_name": group})
        wait_s = min(HELD_PROBE_S, self.health_timeout_s)
        for path, body in (("/end_weight_update", {"abort": True}), leave):
            if (error := self._post_error(url, path, body, wait_s)) is not None:
                return f"still held in {group} ({type(error).__name__})"
        return None

    def _post_error(self, url: str, path: str, body: dict, timeout_s: float) -> httpx.HTTPError | None:
        """POST `path` to `url`; None once it answers (any HTTP status) within `timeout_s`, else the error."""
        try:
            self._http.post(f"{url}{path}", json=body, timeout=timeout_s)
        except httpx.HTTPError as err:
            return err
        return None

    def _health_problem(self, url: str) -> str | None:
        """Why `url` is not ready to generate (None: it is): ``GET /health``, as SGLang's generates one token.

        For start-up (`health`, `wait_until_healthy`) only: SGLang's /health waits out its health
        timeout (20 s) and answers 503 while generation is paused.
        """
        return self._probe(url, "/health")

    def _liveness_problem(self, url: str) -> str | None:
        """Why `url` is lost (None: it answers): ``GET /model_info``.

        The fleet's probe around a weight sync, where the servers may be paused (update_mode
        pause / partial): SGLang answers /model_info at once from its tokenizer manager, paused
        or not, and generates nothing, where its /health would answer 503 after 20 s to a paused
        server (and cost a generation to an unpaused one).
        """
        return self._probe(url, "/model_info")

    def _probe(self, url: str, path: str) -> str | None:
        try:
            response = self._http.get(f"{url}{path}", timeout=self.health_timeout_s)
        except httpx.HTTPError as err:
            return f"{type(err).__name__}: {err}"
        return None if response.status_code == 200 else f"HTTP {response.status_code}"
