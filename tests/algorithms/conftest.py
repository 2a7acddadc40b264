import pytest
import torch


def _token_batch(log_ratios, *, width=None, dtype=torch.float64, pad_value=float("nan")):
    """Builds (log_probs leaf, old_log_probs, mask) from per-row lists of per-token log-ratios.

    log_probs are fixed arbitrary values; old_log_probs = log_probs - log_ratio, so that
    log_probs - old_log_probs equals the given log-ratios. Padding holds ``pad_value`` (NaN by
    default) to prove it is ignored.
    """
    width = width or max(len(row) for row in log_ratios)
    rows = len(log_ratios)
    base = -0.3 - 0.1 * torch.arange(rows * width, dtype=dtype).reshape(rows, width)
    log_probs = torch.full((rows, width), pad_value, dtype=dtype)
    old = torch.full((rows, width), pad_value, dtype=dtype)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for i, row in enumerate(log_ratios):
        n = len(row)
        log_probs[i, :n] = base[i, :n]
        old[i, :n] = base[i, :n] - torch.tensor(row, dtype=dtype)
        mask[i, :n] = True
    return log_probs.requires_grad_(True), old, mask


@pytest.fixture
def token_batch():
    return _token_batch
