"""A fleet of rollout workers found through SGLang's router (pip `sglang-router`).

The router fronts generation (cache-aware placement, retries, circuit breaking); it does not
fan out control calls or weight updates, so the client sends those to every worker the router
lists at ``GET /workers`` (as slime does). A worker that stops answering is removed from the
router (``DELETE /workers/{id}``) so no generation is routed to it, and from the client's list,
so the next weight-update group is built without it; below `min_workers` the run stops with
`FleetTooSmallError`. A removed worker that answers again is synced with the others and only
then added back to the router (``POST /workers``), so it never serves an older version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from megatron_gspo.rollout.errors import RolloutFault, RolloutServerError

REMOVAL_WAIT_S = 10.0
"""How long a removal may take to show in the router's list (it is queued there)."""


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
