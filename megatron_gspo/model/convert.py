"""`python -m megatron_gspo.model.convert`, the conversion check's first path, kept for those who use it.

The conversion lives in `model/hf/convert.py`.
"""

from megatron_gspo.model.hf.convert import main

if __name__ == "__main__":
    raise SystemExit(main())
