"""Where the trainer and the rollout servers run (`rollout.placement`), and the hand-over between them.

- `colocation`: disaggregated or colocated; colocated, the servers sleep while the trainer runs;
- `offload`: the trainer's state out of the compute device while the servers hold it.
"""

from megatron_gspo.placement.colocation import Colocated, Placement
from megatron_gspo.placement.offload import TrainerOffload

__all__ = ["Colocated", "Placement", "TrainerOffload"]
