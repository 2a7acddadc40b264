"""The embedded rollout server: SGLang's HTTP protocol over an HF transformers Qwen3-MoE.

- `service`: each endpoint as SGLang answers it, and the route tables;
- `main`: `megatron-gspo serve` (arguments, model loading, the aiohttp app) and `launch`: starting it
  as a subprocess and waiting until it is healthy;
- `engine` (batched generation, log-probs, routed experts), `scheduler` (continuous batching),
  `protocol` (/generate bodies <-> engine rows), `fields` (request field checks), `http_app`
  (aiohttp in front of the route tables), `weight_receiver` (SGLang's distributed weight update),
  `memory` (SGLang's memory release and resume).

SGLang cannot run on CPU machines, so CPU runs (development, CI, the demo) serve rollouts
with this server; the trainer talks to it with the same client it uses for real SGLang.
What it implements, and how it differs from SGLang:

- POST /generate: SGLang's request contract (same 400s), single or batch (`input_ids` as
  a list of lists) requests, log-probs, routed experts; see `engine.py` for the exact
  log-prob and routing definitions. Concurrent requests are batched (`server.scheduler`).
  Not implemented (400 naming the field): streaming, stop strings, penalties, n > 1, top
  log-probs, constrained decoding. No prefix cache between requests (`cached_tokens` is always 0);
  within one batch, rows with the same prompt share its prefill.
- POST /update_weights_from_disk: really reloads safetensors from `model_path` (same
  architecture), all-or-nothing; /update_weights_from_tensor: SGLang's tensor handles
  (`rollout.tensor_handles`: shared memory on CPU, CUDA IPC on GPU), inside a session as in SGLang.
- POST /init_weights_update_group, /begin_weight_update, /update_weights_from_distributed
  (plain or `flattened_bucket`), /end_weight_update, /destroy_weights_update_group: SGLang's
  distributed update for real, over torch.distributed (gloo on CPU), one rank per server;
  each bucket loaded as it arrives, as SGLang (`weight_receiver.py`).
- POST /pause_generation (SGLang's modes: `abort` returns running requests with what they
  generated; `in_place` / `retract` halt them at a step boundary, KV cache kept / recomputed,
  while weight updates run), /continue_generation, /abort_request (by `rid`, or `abort_all`),
  /flush_cache (nothing is cached between requests, yet refused with 400 when SGLang refuses
  it: unless idle, see `BatchScheduler.idle_for_flush`); GET /health and /health_generate
  (as SGLang's: one token through the batcher, 503 after SGLANG_HEALTH_CHECK_TIMEOUT s, so
  while paused a 503 after that wait), /ready (503 while paused, at once), /model_info (the
  live `model_path` and `weight_version`), /server_info (the launch arguments: launch `model_path` and
  `weight_version`, never updated), and their `/get_` aliases. /get_server_info also
  reports `num_generated_tokens` (not SGLang's): the output tokens decoded since start, so that
  a caller sees a generation under way and how far it got (tests land a weight sync after the
  first N tokens by it, not by a sleep). See docs/sglang-conformance.md.
- GET/POST /release_memory_occupation, /resume_memory_occupation (`tags`: kv_cache, weights,
  cuda_graph) with `--enable-memory-saver`: weights and the `--kv-pool-mb` KV pool really freed and
  re-allocated (RSS drops and returns); generation refused while released (`memory.py`).
- `--dp-size N` makes /get_server_info report SGLang's `dp_size: N` and, above 1, refuses
  what SGLang refuses on a server launched with --dp-size > 1 (/init_weights_update_group,
  /update_weights_from_tensor: its assertion's 500); generation stays one replica.
- `--tp-size N` (with `--base-gpu-id`) makes it report SGLang's `tp_size: N` and open one
  /update_weights_from_tensor entry per TP rank, as SGLang's ranks do (too few refused, ranks'
  tensors that differ refused); it computes as one rank, so it refuses a distributed
  weight-update group above 1 (a colocated run's server spanning N devices).

What it guarantees (tests/rollout/test_server_robustness.py):

- Every request gets an HTTP answer, never a dropped connection: broken framing (bad
  Content-Length, ...) a 400 naming the header; a body that is not UTF-8, not JSON, nested
  too deeply or not an object a 400; a body over `--max-body-mb` a 413.
- Every field an endpoint reads is checked for type and range before use (`server.fields`):
  booleans must be JSON booleans, integers int64 within the field's range, numbers finite
  (NaN / Infinity refused), `rid` a string or one string per row, `text` encodable; the 400
  names the field (`sampling_params[1].temperature`, `rid[2]`, ...).
- A weight update holding NaN/inf is refused naming the tensor (its bucket is not loaded;
  `weight_version` keeps its label).
- GET /health_generate answers within seconds: 503 while generation is paused (SGLang's
  status when it cannot generate), or when no token came within 20 s.
- HTTP is aiohttp (`http_app`) with a listen backlog of 4096; endpoint calls run in
  thread pools: one sized for a full batch of concurrent /generate calls, one for control
  calls (so /continue_generation and /abort_request run however many /generate calls wait).

    megatron-gspo serve --model DIR --port 30000
    python -m megatron_gspo.rollout.server --model DIR --port 30000
"""
