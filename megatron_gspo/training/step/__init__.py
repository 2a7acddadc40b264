"""One RL step's stages, in the order the trainer runs them.

- `rollouts`: prompts -> one batched /generate per server -> a validated batch;
- `scoring`: rank 0's rewards and advantages over the whole batch, then the rows trained on;
- `scatter`: those rows from rank 0 to the data-parallel ranks;
- `micro_batches` (with `balance`): each rank's rows cut into micro-batches; `forward`: the packed
  micro-batch every pass runs;
- `routing`: Routing Replay (R2 / R3) and expert-activation drift; `token_kl`: ROLL's reward-side KL;
- `update`: mini-batches -> micro-batches -> optimizer steps;
- `metrics`: what the step reports beside the loss.
"""
