"""megatron-gspo: GSPO / GRPO RL for Mixture-of-Experts LLMs on Megatron-Core with SGLang rollouts."""

__version__ = "0.1.0"
