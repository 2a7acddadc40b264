"""The embedded server's `meta_info.weight_versions` spans are SGLang 0.5.23's, computed by its own code.

SGLang's `srt/utils/weight_versions.py` (`compute_weight_version_spans`, then
`add_weight_versions_to_meta_info`) is loaded from the installed wheel's source by path (its one
sglang import, a pydantic schema helper, stubbed) and run on the same events as
`protocol.weight_version_spans`; the end-to-end pause tests (test_server_pause.py) check the
events the engine records.
"""

import importlib.util
import pathlib
import sys
import types

import pytest

from megatron_gspo.rollout import contract
from megatron_gspo.rollout.server.protocol import weight_version_spans


def sglang_weight_versions():
    api = contract.load()
    if api is None:
        pytest.skip("SGLang's source is not installed")
    path = pathlib.Path(api.__file__).parents[2] / "srt" / "utils" / "weight_versions.py"
    stub = types.ModuleType("sglang.srt.utils.msgspec_utils")
    stub.msgspec_struct_pydantic_core_schema = lambda cls, handler: None
    saved = sys.modules.get(stub.__name__)
    sys.modules[stub.__name__] = stub
    try:
        spec = importlib.util.spec_from_file_location("sglang_weight_versions_under_test", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses and msgspec resolve annotations through it
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules[stub.__name__]
        else:
            sys.modules[stub.__name__] = saved
    return module


CASES = [  # (events (old version, output tokens then), current version, tokens generated, tokens returned)
    ([], "3", 5, 5),  # no update landed: one span
    ([("3", 2)], "4", 5, 5),  # one update while held after 2 tokens
    ([("3", 2), ("4", 2)], "5", 5, 5),  # two updates within one hold: the first old version counts
    ([("3", 2), ("4", 4)], "5", 6, 6),
    ([("3", 2)], "3", 5, 5),  # an update that kept the label merges
    ([("3", 4)], "4", 4, 4),  # aborted right after the update: the new version generated nothing
    ([("3", 4)], "4", 6, 0),  # aborted in the waiting queue, nothing streamed yet
    ([("3", 2), ("4", 4)], "5", 7, 3),  # aborted in the waiting queue, 3 tokens streamed
    ([], "3", 0, 0),  # aborted before its first token
]


@pytest.mark.parametrize(("events", "current", "total", "visible"), CASES)
def test_spans_equal_sglangs(events, current, total, visible):
    wv = sglang_weight_versions()
    spans = wv.compute_weight_version_spans(
        [wv.WeightVersionEvent(old_version=v, num_output_tokens=n) for v, n in events],
        current_version=current,
        num_output_tokens=total,
    )
    meta = {}
    wv.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=visible)
    ours = weight_version_spans(events, current, total, visible)
    assert ours == meta["weight_versions"]
    assert ours[-1]["version"] == meta["weight_version"]  # the response's weight_version
    api = contract.load()  # and the response contract takes them
    api.GenerateResponse.from_json_value(
        {"text": "", "output_ids": [], "meta_info": {"id": "r", "weight_versions": ours}}
    )
