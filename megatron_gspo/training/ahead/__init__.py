"""Rollouts ahead of training (`rollout.max_staleness >= 1`): a producer beside the loop, not a second loop.

- `queue`: rank 0's producer thread and the bounded queue of versioned batches;
- `rollouts_ahead`: those batches as one step uses them;
- `staleness`: the weight versions of responses whose segments span syncs, and what may train;
- `inflight_updates`: weight syncs with requests in flight (`rollout.update_mode: pause | partial`).
"""
