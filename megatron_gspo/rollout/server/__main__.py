"""`python -m megatron_gspo.rollout.server`: the embedded rollout server (`megatron-gspo serve`)."""

import sys

from megatron_gspo.rollout.server.main import main

sys.exit(main())
