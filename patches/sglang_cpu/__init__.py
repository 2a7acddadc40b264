"""SGLang's CPU engine on a host without a GPU (`gpuless.py`, loaded in SGLang's own environment)."""
