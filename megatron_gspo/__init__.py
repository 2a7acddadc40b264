"""megatron-gspo: GSPO / GRPO RL for Mixture-of-Experts LLMs on Megatron-Core with SGLang rollouts."""

from megatron_gspo import deferred_compile

__version__ = "0.1.0"

deferred_compile.install()  # before any megatron-core import: see the module
