"""Request bodies for SGLang's ``/generate``, checked against SGLang's own contract types."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from megatron_gspo.rollout import contract


def build_generate_request(
    prompt_ids: Sequence[int],
    sampling_params: Mapping[str, Any],
    *,
    return_logprob: bool = True,
    return_routed_experts: bool = False,
    rid: str | None = None,
    check_sampling_params: bool = True,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """A non-streaming ``/generate`` body for one prompt, in SGLang's request contract.

    Routed experts are requested from position 0 (``routed_experts_start_len=0``) so their rows
    cover positions ``[0, P + R - 1)``, as `parse_generate_response` assumes. Log-probs cover the
    generated tokens only (SGLang's default ``logprob_start_len=-1``).

    Args:
        prompt_ids: prompt token ids ``[P]``.
        sampling_params: SGLang sampling params (``max_new_tokens``, ``temperature``, ``top_p``,
            ``top_k``, ``stop``, ``ignore_eos``, ``sampling_seed``, ...).
        return_logprob: ask for per-token log-probs of the generated tokens.
        return_routed_experts: ask for the experts each token was routed to (MoE only; the
            server must run with ``--enable-return-routed-experts``).
        rid: request id, echoed by the server as ``meta_info.id``.
        check_sampling_params: check them against SGLang's contract. A batch whose rows differ
            only in ``sampling_seed`` checks its first row's (the check costs a tenth of the
            producer's CPU per batch on small models).
        vocab_size: when given, every prompt id must be below it. SGLang does not check: a prompt
            id outside the model's vocabulary kills its scheduler (an IndexError in the embedding,
            0.5.23 on CPU), the whole server with it, so it is refused here, before it is sent.

    Returns:
        The JSON-ready body.

    Raises:
        ValueError: an empty prompt, a non-integer token id, one outside `vocab_size`, or sampling
            params that SGLang's
            contract rejects (when the contract types are installed; the message is SGLang's).
    """
    ids = prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
    if not ids:
        raise ValueError("prompt_ids is empty")
    bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or t < 0), None)
    if bad is not None:
        raise ValueError(f"prompt_ids must be non-negative integers, found {bad!r}")
    if vocab_size is not None and (outside := sorted({t for t in ids if t >= vocab_size})):
        raise ValueError(
            f"prompt_ids hold token ids outside the model's vocabulary [0, {vocab_size}): {outside[:8]} "
            "(the tokenizer knows more tokens than the checkpoint's vocab_size)"
        )
    if not isinstance(sampling_params, Mapping):
        raise ValueError(f"sampling_params must be a mapping, got {type(sampling_params).__name__}")
    api = contract.load() if check_sampling_params else None
    if api is not None:
        try:
            api.SamplingParams.from_json_value(dict(sampling_params))
        except api.JsonContractError as err:
            raise ValueError(f"sampling_params rejected by SGLang's contract: {err}") from None
    body: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": dict(sampling_params),
        "return_logprob": bool(return_logprob),
        "stream": False,
    }
    if return_routed_experts:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = 0
    if rid is not None:
        body["rid"] = rid
    return body
