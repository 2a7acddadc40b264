"""Errors of the rollout side: talking to SGLang servers and validating what they return.

Two families:

- transport (`RolloutServerError`, `RolloutRequestError`, `WeightUpdateError`,
  `RolloutBatchTimeoutError`): a server could not be reached, refused a request, reported a
  failed weight update, or a batch outlasted its time cap. Each names the URL(s).
- data (`RolloutValidationError` and its subclasses, all `ValueError`): a response or a batch
  that must not be trained on. Each names the field (``meta_info.output_token_logprobs``,
  ``routed_experts``, ...) and, where known, the sample.
"""

from __future__ import annotations

from collections.abc import Sequence


class RolloutFault(RuntimeError):
    """Base of the run-time failures of the rollout side (a server lost, hung, or refusing weights).

    The command line reports one as a single line naming the server(s), exit status 1.
    """


class RolloutServerError(RolloutFault):
    """A server stayed unreachable (connection errors, timeouts, 5xx) through every retry.

    Attributes:
        url: the server of the last attempt.
        urls: every server tried, in order of first use.
        path: the endpoint, e.g. ``/generate``.
        attempts: how many HTTP attempts were made.
        last_error: a description of the last failure.
    """

    def __init__(self, *, url: str, path: str, attempts: int, last_error: str, urls: Sequence[str] = ()):
        self.url = url
        self.urls = list(urls) or [url]
        self.path = path
        self.attempts = attempts
        self.last_error = last_error
        tried = ", ".join(self.urls)
        super().__init__(
            f"{path} failed after {attempts} attempt(s) (servers tried: {tried}); "
            f"last error from {url}: {last_error}"
        )


class RolloutBatchTimeoutError(RolloutFault):
    """A batch of /generate requests did not finish within the client's `batch_timeout_s`.

    Attributes:
        timeout_s: the cap that was exceeded.
        pending_urls: servers that still had requests of the batch in flight.
        pending: requests of the batch not finished (in flight or never sent).
        total: requests in the batch.
    """

    def __init__(self, *, timeout_s: float, pending_urls: Sequence[str], pending: int, total: int):
        self.timeout_s = timeout_s
        self.pending_urls = list(pending_urls)
        self.pending = pending
        self.total = total
        servers = ", ".join(self.pending_urls) or "none (requests still queued in the client)"
        super().__init__(
            f"rollout batch not done after {timeout_s:g} s (rollout.batch_timeout_s): {pending} of "
            f"{total} request(s) pending; servers still working: {servers}. The rest was cancelled "
            "and the pending requests aborted on their servers."
        )


class GenerationCancelledError(RolloutFault):
    """A `generate` call was cancelled (`SGLangClient.cancel_generation`: the run is stopping)."""


class RolloutRequestError(RuntimeError):
    """A server refused a request with a 4xx status; retrying the same body cannot help.

    Attributes:
        url: the server that answered.
        path: the endpoint.
        status_code: the HTTP status.
        server_message: the server's own explanation (the ``error.message`` / ``message`` field of
            its JSON body, or the raw body text).
    """

    def __init__(self, *, url: str, path: str, status_code: int, server_message: str):
        self.url = url
        self.path = path
        self.status_code = status_code
        self.server_message = server_message
        super().__init__(f"{url}{path} rejected the request with HTTP {status_code}: {server_message}")


class WeightUpdateError(RolloutFault):
    """A server answered a weight-sync or memory call with ``success: false`` (or an error status).

    Attributes:
        url: the server that failed.
        path: the endpoint, e.g. ``/update_weights_from_disk``.
        server_message: the ``message`` the server returned.
    """

    def __init__(self, *, url: str, path: str, server_message: str):
        self.url = url
        self.path = path
        self.server_message = server_message
        super().__init__(f"{url}{path} reported failure: {server_message}")


class RolloutValidationError(ValueError):
    """A rollout response or batch is not fit to train on.

    Attributes:
        field: the offending field, dotted from the response root
            (e.g. ``meta_info.output_token_logprobs[3]``), or a batch-level name.
        problem: what was wrong with it.
        sample: an identifier of the sample (request id or batch position), when known.
    """

    def __init__(self, field: str, problem: str, *, sample: str | int | None = None):
        self.field = field
        self.problem = problem
        self.sample = sample
        where = f"sample {sample}: " if sample is not None else ""
        super().__init__(f"{where}field `{field}`: {problem}")


class MalformedResponseError(RolloutValidationError):
    """The response is not the JSON shape SGLang documents: bad JSON, a missing field, a wrong type."""


class EmptyResponseError(RolloutValidationError):
    """The response holds no generated token (nothing to train on, nothing to score)."""


class LengthMismatchError(RolloutValidationError):
    """Counts that must agree do not (log-probs vs tokens, ``prompt_tokens`` vs the prompt, ...)."""


class InvalidLogprobError(RolloutValidationError):
    """A log-probability is missing, not finite, or positive beyond rounding."""


class TokenIdError(RolloutValidationError):
    """A token id is negative, outside the vocabulary, or disagrees between two fields."""


class FinishReasonError(RolloutValidationError):
    """``meta_info.finish_reason`` is missing, malformed, or reports an aborted generation."""


class RoutedExpertsError(RolloutValidationError):
    """``meta_info.routed_experts`` is missing when asked for, not base64, the wrong size, or out of range."""


class WeightVersionError(RolloutValidationError):
    """``meta_info.weight_version`` is malformed, or one response spans several weight versions."""


class StaleRolloutError(RolloutValidationError):
    """Samples were generated by weights other than the version the trainer expects."""


class GroupError(RolloutValidationError):
    """A prompt group is incomplete or mixes different prompts (group advantages need full groups)."""


class BatchLayoutError(RolloutValidationError):
    """Samples of one batch disagree in layout (routed-expert shapes, present vs absent, ...)."""


class EmptyBatchError(RolloutValidationError):
    """No group survived validation: there is nothing left to train on."""
