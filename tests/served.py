"""What a rollout server serves, read back through its HTTP API for comparison with the trainer."""

import torch

from megatron_gspo.rollout.client import SGLangClient


def served_logprobs(client: SGLangClient, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T - 1] teacher-forced log-probs of `tokens`' rows [B, T] from the first server (float64).

    Each row is sent as a prompt with `logprob_start_len=0`; the server's input log-probs from the
    second token on are those of the trainer's `sequence_logprobs` from its second column on.
    """
    rows = []
    for row in tokens.tolist():
        body = {
            "input_ids": row,
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        answer = client.generate([body])[0]
        rows.append([lp for lp, _, _ in answer["meta_info"]["input_token_logprobs"][1:]])
    return torch.tensor(rows, dtype=torch.float64)
