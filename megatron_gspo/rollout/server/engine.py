"""Batched generation with an HF Qwen3-MoE: tokens, SGLang-style log-probs and routed experts.

The model half of the embedded SGLang-protocol server (`rollout/server/`). One call of
`GenerationEngine.generate` runs a left-padded batch: one prefill forward over the distinct
prompts (the rows of a group share their prompt's, as SGLang's prefix cache shares it; in
fp32 a shared row's values equal a solo prefill's to ~1e-7, not bit for bit, since matmul
kernels block by batch size), then one single-token forward per decode step with a
`DynamicCache` (KV cache) expanded to every row; a row that finished leaves the batch and
the cache (as in SGLang), until none is left.

Definitions follow SGLang 0.5.23 (`srt/layers/sampler.py`, `logprob_processor.py`):
- output log-probs: `log_softmax(logits / temperature)` of the full vocabulary, before
  top-k/top-p/min-p filtering; raw `log_softmax(logits)` in original-logprob mode
  (SGLANG_RETURN_ORIGINAL_LOGPROB=1) and for greedy rows (temperature 0). top_k=1 with a
  positive temperature decodes by argmax but reports the temperature-scaled log-prob
  (SGLang's value there depends on whether the whole batch is greedy; ours does not).
- input log-probs: raw `log_softmax(logits)` (SGLang never scales prefill log-probs); the
  entry for the token at `logprob_start_len` is None, as SGLang returns it.
- routed experts: captured from each layer's `Qwen3MoeTopKRouter` output (the indices the
  experts were actually run with: top-k of the fp32 softmax of the router logits, torch.topk
  tie order) during prefill and decoding, not recomputed afterwards. Row j is the routing of
  the token at position j; the last generated token is never run through the model.
- sampling: each row draws from its own `torch.Generator` (seeded by `sampling_seed`, else
  from the engine's seed stream) with the exponential-race trick `argmax(p / Exp(1))`, so a
  seeded request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from megatron_gspo.model.hf.checkpoint import (
    check_finite,
    copy_into_model,
    hf_to_module_state,
    load_hf_state_dict,
)
from megatron_gspo.rollout.server.decode_aids import DecodeAids
from megatron_gspo.rollout.server.memory import MemoryOccupation

GREEDY_EPS = 1e-6  # SGLang treats temperature below this as greedy


@dataclass(frozen=True)
class SamplingOptions:
    """Per-request sampling parameters the engine implements (a subset of SGLang's)."""

    max_new_tokens: int = 128
    """Tokens to generate at most."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus mass kept (1 keeps all)."""
    top_k: int = -1
    """Most likely tokens kept (-1 or >= vocab keeps all)."""
    min_p: float = 0.0
    """Drop tokens with probability below min_p * max probability."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the generation (they are kept in `output_ids`)."""
    ignore_eos: bool = False
    """Keep generating past EOS."""
    sampling_seed: int | None = None
    """Seed of this request's own generator; same seed, same tokens."""

    @property
    def greedy(self) -> bool:
        """Argmax decoding with raw log-probs."""
        return self.temperature < GREEDY_EPS


@dataclass
class GenerationInput:
    """One sequence to generate from."""

    input_ids: list[int]
    """Prompt token ids (non-empty)."""
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    """How to sample."""
    logprob_start_len: int = -1
    """First prompt position whose log-prob is returned; -1 returns none."""
    return_routed_experts: bool = False
    """Return the routing of positions [routed_experts_start_len, seqlen - 1)."""
    routed_experts_start_len: int = 0
    """First position of the returned routing."""
    abort: threading.Event = field(default_factory=threading.Event)
    """Set to stop this row at the next decode step (finish reason `abort`)."""


@dataclass
class GenerationOutput:
    """What one row produced."""

    output_ids: list[int]
    """Generated tokens, including a matched stop token."""
    output_logprobs: list[float]
    """Log-prob of each generated token (see module docstring for which)."""
    input_logprobs: list[float | None] | None
    """Prompt log-probs from `logprob_start_len` (first entry None), or None."""
    routed_experts: np.ndarray | None
    """int32 [seqlen - 1 - start, num_layers, topk] routing, or None."""
    finish_reason: dict
    """SGLang finish reason: {"type": "length", "length": N} / {"type": "stop", "matched": id} / abort."""
    weight_version: str
    """Weights the row was generated with."""
    weight_version_events: list[tuple[str, int]] = field(default_factory=list)
    """(old version, output tokens then) per weight update that landed while the row was held
    with tokens out: SGLang's `Req.weight_version_events`, from which `meta_info.weight_versions`
    spans are computed (`protocol.weight_version_spans`)."""
    aborted_waiting: bool = False
    """Aborted while in SGLang's waiting queue (never started, or retracted by a `retract` pause):
    SGLang answers it from the tokenizer manager (`_handle_abort_req`), without routed experts,
    prompt/cached token counts, and with only the tokens already streamed to it."""


class GenerationEngine:
    """An HF causal LM on CPU/GPU with batched generation and in-place weight updates.

    Thread safety: `generate` and the weight updates take one lock, so a weight update waits
    for the running batch and never mixes versions inside one batch.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        return_original_logprob: bool = False,
        weight_version: str = "default",
        seed: int = 0,
        device: str = "cpu",
        aids: DecodeAids | None = None,
        enable_memory_saver: bool = False,
        kv_pool_bytes: int = 0,
    ) -> None:
        self.model_path = str(model_path)
        self.aids = aids  # the test aids (rollout/server/decode_aids.py); None unless a flag set them
        self.dtype = dtype
        self.device = torch.device(device)
        self.return_original_logprob = return_original_logprob
        self.weight_version = weight_version
        self._lock = threading.Lock()
        # Generation pause (SGLang's /pause_generation in_place / retract): a running batch waits
        # at its next step boundary with the lock released, so weight updates can run meanwhile.
        self._resumed = threading.Condition(self._lock)
        self._paused = False
        self._retract = False
        self._seed_stream = torch.Generator().manual_seed(seed)
        self.tokens_generated = 0
        """Output tokens decoded since start (all rows, all requests): /get_server_info's
        `num_generated_tokens`, which tells a caller that a generation is under way and how far,
        e.g. a test that must land a weight sync after the first N tokens and not before."""
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(self.device).eval()
        cfg = self.model.config
        self.num_layers = cfg.num_hidden_layers
        self.topk = cfg.num_experts_per_tok
        self.num_experts = cfg.num_experts
        self.context_len = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        pad = self.model.generation_config.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (self.tokenizer.pad_token_id or 0))
        self._captured: list[torch.Tensor] = []
        self._routers = [m for m in self.model.modules() if type(m).__name__.endswith("TopKRouter")]
        if len(self._routers) != self.num_layers:
            raise ValueError(
                f"expected {self.num_layers} MoE routers, found {len(self._routers)} in {model_path}"
            )
        for router in self._routers:
            router.register_forward_hook(self._capture_routing)
        self.memory = MemoryOccupation(self.model, enabled=enable_memory_saver, kv_pool_bytes=kv_pool_bytes)
        """SGLang's /release_memory_occupation and /resume_memory_occupation (`memory.py`)."""

    def _capture_routing(self, module, inputs, output) -> None:
        self._captured.append(output[2])  # (router_logits, router_scores, router_indices [tokens, k])

    # ------------------------------------------------------------------ weights
    def update_weights_from_disk(self, model_path: str | Path, weight_version: str | None = None) -> None:
        """Load every tensor of the safetensors checkpoint at `model_path` into the model.

        The checkpoint must have this model's architecture, hold every parameter and only
        finite values; on any error the served weights and version are unchanged (tensors are
        all read and checked first).
        """
        self.memory.check_update()  # before the shapes are compared with released (empty) ones
        path = Path(model_path)
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise FileNotFoundError(f"{path} has no config.json")
        disk_cfg = json.loads(cfg_file.read_text())
        if "num_local_experts" in disk_cfg:  # transformers 5.x's name for it
            disk_cfg["num_experts"] = disk_cfg["num_local_experts"]
        for key in ("num_hidden_layers", "hidden_size", "num_experts", "vocab_size", "num_experts_per_tok"):
            if disk_cfg.get(key) != getattr(self.model.config, key):
                raise ValueError(
                    f"{path}: {key}={disk_cfg.get(key)} differs from the served model's "
                    f"{getattr(self.model.config, key)}"
                )
        on_disk = load_hf_state_dict(path)
        check_finite(on_disk, str(path))
        fused = hf_to_module_state(on_disk, self.num_experts)
        own = self.model.state_dict()
        if self.model.config.tie_word_embeddings:
            fused.pop("lm_head.weight", None)
            own.pop("lm_head.weight", None)
        missing = sorted(set(own) - set(fused))
        unexpected = sorted(set(fused) - set(own))
        if missing or unexpected:
            raise ValueError(f"{path}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
        for name, tensor in fused.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"{path}: {name} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}"
                )
        with self._lock:
            self.memory.check_update()
            copy_into_model(self.model, fused)
            self.memory.after_update()
            self.model_path = str(path)
            self._set_version(weight_version)

    def update_weights_from_tensors(
        self, named_tensors: dict[str, torch.Tensor], weight_version: str | None
    ) -> int:
        """Copy named tensors (HF on-disk or in-memory names; partial sets allowed) into the model.

        All or nothing without a backup copy: a tensor with NaN/inf is refused, and
        `copy_into_model` checks every name and shape before it copies anything.
        """
        check_finite(named_tensors, "update_weights_from_tensor")
        with self._lock:
            self.memory.check_update()
            count = copy_into_model(self.model, named_tensors)
            self.memory.after_update()
            self._set_version(weight_version)
        return count

    def _set_version(self, weight_version: str | None) -> None:
        # As SGLang (`_update_weight_version_if_provided`): an update without one keeps the label.
        if weight_version is not None:
            self.weight_version = str(weight_version)

    def release_memory(self, tags: tuple[str, ...]) -> None:
        """Free the memory regions `tags` (`memory.MemoryOccupation.release`), between batches."""
        with self._lock:
            self.memory.release(tags)

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        """Re-allocate the memory regions `tags` (`memory.MemoryOccupation.resume`)."""
        with self._lock:
            self.memory.resume(tags)

    # ------------------------------------------------------------------ pause
    def pause(self, *, retract: bool) -> None:
        """Hold generation at the next step boundary; returns once no forward is running.

        A batch held here keeps its KV cache (`retract=False`, SGLang's `in_place`: decoding
        resumes on the cache the old weights computed) or recomputes it on resume with the
        weights then served (`retract=True`, SGLang's `retract`). Weight updates run while held.
        """
        self._retract = retract
        self._paused = True
        with self._lock:  # taken only once the running batch waits (or none runs)
            pass

    def resume(self) -> None:
        """Let held batches go on."""
        with self._lock:
            self._paused = False
            self._resumed.notify_all()

    def _hold_while_paused(self, items: list[GenerationInput], rows: list[int]) -> str | None:
        """Wait (lock released) while paused; the pause mode it waited in, or None if it did not.

        Rows aborted while held end the wait too, so an abort never waits for /continue_generation.
        """
        if not self._paused:
            return None
        retract = self._retract
        while self._paused and not all(items[b].abort.is_set() for b in rows):
            self._resumed.wait(0.05)  # an abort sets an Event, not this condition: look again soon
        return "retract" if retract else "in_place"

    # --------------------------------------------------------------- generation
    def check_input(self, item: GenerationInput) -> None:
        """Raise ValueError (SGLang's wording where it has one) for inputs the engine cannot run."""
        n = len(item.input_ids)
        if n == 0:
            raise ValueError("input_ids is empty")
        bad = [t for t in item.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids contain token ids outside [0, {self.vocab_size}): {bad[:5]}")
        if n >= self.context_len:
            raise ValueError(
                f"The input ({n} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)."
            )
        if n + item.sampling.max_new_tokens > self.context_len:
            raise ValueError(
                "Requested token count exceeds the model's maximum context length of "
                f"{self.context_len} tokens. You requested a total of {n + item.sampling.max_new_tokens} "
                f"tokens: {n} tokens from the input messages and {item.sampling.max_new_tokens} tokens "
                "for the completion."
            )
        if item.logprob_start_len >= n:
            raise ValueError(
                f"logprob_start_len ({item.logprob_start_len}) must be < the prompt length ({n})"
            )
        if not 0 <= item.routed_experts_start_len < n:
            raise ValueError(
                f"routed_experts_start_len ({item.routed_experts_start_len}) must be in [0, {n})"
            )

    @torch.no_grad()
    def generate(self, items: list[GenerationInput]) -> list[GenerationOutput]:
        """Generate for a batch of rows (left-padded together); see the module docstring."""
        for item in items:
            self.check_input(item)
        with self._lock:
            return self._generate_locked(items)

    def _generate_locked(self, items: list[GenerationInput]) -> list[GenerationOutput]:
        self.memory.check_generation()
        bsz = len(items)
        lens = [len(it.input_ids) for it in items]
        width = max(lens)
        pad = [width - n for n in lens]  # left padding
        ids = torch.tensor([[self.pad_token_id] * p + it.input_ids for p, it in zip(pad, items)])
        mask = torch.tensor([[0] * p + [1] * n for p, n in zip(pad, lens)])
        generators = [self._generator(it.sampling) for it in items]
        self._hold_while_paused(items, list(range(bsz)))  # nothing computed yet: any mode starts fresh
        cache = DynamicCache(config=self.model.config)

        # Prefill: all prompt positions at once, once per distinct prompt (a group's rows share
        # theirs, as SGLang reuses a cached prefix); the cache is then expanded to every row.
        distinct: dict[tuple[int, ...], int] = {}
        row_of = torch.tensor([distinct.setdefault(tuple(it.input_ids), b) for b, it in enumerate(items)])
        if len(distinct) < bsz:
            firsts = torch.tensor(list(distinct.values()))
            logits, routing = self._forward(ids[firsts], mask[firsts], cache)
            shared = torch.full((bsz,), -1, dtype=torch.long)
            shared[firsts] = torch.arange(len(firsts))
            index = shared[row_of]
            cache.reorder_cache(index)
            logits, routing = logits[index], routing[index]
        else:
            logits, routing = self._forward(ids, mask, cache)
        prefill_routing = routing  # [B, L, width, k]
        input_logprobs = [
            self._input_logprobs(it, logits[b, pad[b] :]) if it.logprob_start_len >= 0 else None
            for b, it in enumerate(items)
        ]

        outputs: list[list[int]] = [[] for _ in items]
        out_lps: list[list[float]] = [[] for _ in items]
        finish: list[dict | None] = [None] * bsz
        for b, it in enumerate(items):
            if it.sampling.max_new_tokens == 0:
                finish[b] = {"type": "length", "length": 0}
        # Rows still generating; a finished row leaves the batch (and the cache), as in SGLang.
        rows = [b for b in range(bsz) if finish[b] is None]
        if len(rows) < bsz:
            cache.reorder_cache(torch.tensor(rows, dtype=torch.long))
            mask = mask[rows]
        next_logits = logits[rows, -1]
        decode_routing: list[list[torch.Tensor]] = [[] for _ in items]  # per row, per step [L, k]
        events: list[list[tuple[str, int]]] = [[] for _ in items]  # per row, SGLang's weight_version_events
        waiting = [False] * bsz  # aborted while retracted (SGLang: in the waiting queue)
        prefix: list[torch.Tensor | None] = [None] * bsz  # per row [positions, L, k] of a retract's prefill
        want_routing = any(it.return_routed_experts for it in items)
        hold = self.aids is not None and self.aids.batch_holds(self.weight_version)
        while rows:
            tokens, lps = self._sample(next_logits, [items[b] for b in rows], [generators[b] for b in rows])
            step_tokens, step_lps = tokens.tolist(), lps.tolist()  # one read per step, not two per row
            for i, b in enumerate(rows):
                it = items[b]
                if it.abort.is_set():
                    finish[b] = {"type": "abort", "message": "Abort before decoding this token."}
                    continue
                outputs[b].append(step_tokens[i])
                out_lps[b].append(step_lps[i])
                finish[b] = self._finish_reason(it.sampling, step_tokens[i], len(outputs[b]))
                self.tokens_generated += 1
            going = [i for i, b in enumerate(rows) if finish[b] is None]
            if not going:
                break
            if len(going) < len(rows):
                keep = torch.tensor(going)
                cache.reorder_cache(keep)
                mask, tokens = mask[keep], tokens[keep]
                rows = [rows[i] for i in going]
            going_rows = list(rows)
            if self.aids is not None:  # lock held: no weight update lands inside a step
                aborted = [items[b].abort for b in rows]
                self.aids.at_step(hold, lambda: self._paused or all(a.is_set() for a in aborted))  # noqa: B023
            hold = False
            version_before = self.weight_version
            held = self._hold_while_paused(items, rows)
            if held is not None:
                if self.weight_version != version_before:  # SGLang's record_weight_version_events
                    for b in going_rows:
                        events[b].append((version_before, len(outputs[b])))
                rows = [b for b in rows if not items[b].abort.is_set()]
                for b in set(going_rows) - set(rows):
                    # A retracted request waits in SGLang's queue; aborted there, it is answered
                    # without its routes (see GenerationOutput.aborted_waiting).
                    waiting[b] = held == "retract"
                    finish[b] = {
                        "type": "abort",
                        "message": "Abort in waiting queue"
                        if waiting[b]
                        else "Aborted while generation was paused.",
                    }
                if not rows:
                    break
            if held == "retract":  # the cache is recomputed with the weights served now
                cache, mask, logits, routing = self._prefill([items[b].input_ids + outputs[b] for b in rows])
                if want_routing:
                    width = mask.shape[1]
                    for i, b in enumerate(rows):
                        n = len(items[b].input_ids) + len(outputs[b])
                        prefix[b] = routing[i, :, width - n :].permute(1, 0, 2)
                        decode_routing[b] = []
                next_logits = logits[:, -1]
                continue
            if held is not None and len(rows) < tokens.shape[0]:  # rows aborted while held
                keep = torch.tensor([going_rows.index(b) for b in rows])
                cache.reorder_cache(keep)
                mask, tokens = mask[keep], tokens[keep]
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
            logits, routing = self._forward(tokens.view(len(rows), 1), mask, cache)
            if want_routing:
                for i, b in enumerate(rows):
                    decode_routing[b].append(routing[i, :, 0])
            next_logits = logits[:, -1]

        if self.aids is not None:
            self.aids.batch_ended(self.weight_version, sum(f["type"] != "abort" for f in finish))
        results = []
        for b, it in enumerate(items):
            routed = None
            if it.return_routed_experts and not waiting[b]:
                if prefix[b] is None:
                    prefix[b] = prefill_routing[b, :, pad[b] :].permute(1, 0, 2)  # [P, L, k]
                per_token = [prefix[b]] + [r.unsqueeze(0) for r in decode_routing[b]]
                seq_rows = torch.cat(per_token, dim=0)[: lens[b] + len(outputs[b]) - 1]
                routed = seq_rows[it.routed_experts_start_len :].to(torch.int32).contiguous().numpy()
            results.append(
                GenerationOutput(
                    output_ids=outputs[b],
                    output_logprobs=out_lps[b],
                    input_logprobs=input_logprobs[b],
                    routed_experts=routed,
                    finish_reason=finish[b],
                    weight_version=self.weight_version,
                    weight_version_events=events[b],
                    aborted_waiting=waiting[b],
                )
            )
        return results

    def _generator(self, sampling: SamplingOptions) -> torch.Generator:
        if sampling.sampling_seed is not None:
            seed = sampling.sampling_seed
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_stream))
        return torch.Generator().manual_seed(seed)

    def _prefill(
        self, seqs: list[list[int]]
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fresh KV cache over left-padded `seqs`: (cache, mask, logits [B, W, V], routing [B, L, W, k])."""
        width = max(len(q) for q in seqs)
        ids = torch.tensor([[self.pad_token_id] * (width - len(q)) + q for q in seqs])
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in seqs])
        cache = DynamicCache(config=self.model.config)
        logits, routing = self._forward(ids, mask, cache)
        return cache, mask, logits, routing

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the new tokens `ids` [B, S] given the full `mask` [B, T].

        Returns:
            logits [B, S, V] (fp32) and routing indices [B, L, S, k].
        """
        bsz, seq = ids.shape
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -seq:]
        self._captured.clear()
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        routing = torch.stack([r.view(bsz, seq, self.topk) for r in self._captured], dim=1).cpu()
        self._captured.clear()
        return out.logits.float().cpu(), routing

    def _input_logprobs(self, item: GenerationInput, logits: torch.Tensor) -> list[float | None] | None:
        """SGLang's input_token_logprobs from `logprob_start_len`; `logits` [P, V] of the prompt."""
        start = item.logprob_start_len
        if start < 0:
            return None
        lp = torch.log_softmax(logits, dim=-1)  # raw: SGLang does not scale prefill log-probs
        targets = torch.tensor(item.input_ids[start + 1 :], dtype=torch.long)
        vals = lp[start : len(item.input_ids) - 1].gather(1, targets.unsqueeze(1)).squeeze(1)
        return [None] + vals.tolist()

    def _sample(
        self, logits: torch.Tensor, items: list[GenerationInput], generators: list[torch.Generator]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token and its reported log-prob for each row; `logits` [B, V] fp32."""
        temps = torch.tensor([1.0 if it.sampling.greedy else it.sampling.temperature for it in items])
        scaled_lp = torch.log_softmax(logits / temps.unsqueeze(1), dim=-1)
        report_lp = scaled_lp
        if self.return_original_logprob and not bool((temps == 1.0).all()):
            report_lp = torch.log_softmax(logits, dim=-1)
        options = [it.sampling for it in items]
        greedy = torch.tensor([sp.greedy or sp.top_k == 1 for sp in options])
        tokens = torch.argmax(logits, dim=-1)
        sampled = (~greedy).nonzero().flatten().tolist()
        if sampled:  # one batched filter; each row's noise from its own generator (seeded rows repeat)
            probs = filter_probs(
                scaled_lp[sampled].exp(),
                top_k=torch.tensor([options[b].top_k for b in sampled]),
                top_p=torch.tensor([options[b].top_p for b in sampled], dtype=logits.dtype),
                min_p=torch.tensor([options[b].min_p for b in sampled], dtype=logits.dtype),
            )
            noise = torch.empty_like(probs)
            for row, b in zip(noise, sampled):
                row.exponential_(generator=generators[b])
            tokens[sampled] = torch.argmax(probs / noise, dim=-1)
        return tokens, report_lp.gather(1, tokens.unsqueeze(1)).squeeze(1)

    def _finish_reason(self, sampling: SamplingOptions, token: int, n_out: int) -> dict | None:
        if token in sampling.stop_token_ids or (not sampling.ignore_eos and token in self.eos_token_ids):
            return {"type": "stop", "matched": token}
        if n_out >= sampling.max_new_tokens:
            return {"type": "length", "length": sampling.max_new_tokens}
        return None


def filter_probs(
    probs: torch.Tensor,
    *,
    top_k: int | torch.Tensor = -1,
    top_p: float | torch.Tensor = 1.0,
    min_p: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """Zero the tokens outside top-k / top-p / min-p (SGLang's order); unnormalised result.

    `probs` is [V] or [B, V]; each option is a number or one value per row ([B]). The most
    likely token always survives; the sampler needs no renormalisation because the
    exponential race `argmax(p / Exp(1))` samples proportionally to the remaining mass.
    """
    rows = probs if probs.dim() == 2 else probs.unsqueeze(0)
    vocab = rows.shape[-1]

    def column(value, dtype) -> torch.Tensor:
        return torch.as_tensor(value, dtype=dtype).reshape(-1, 1).expand(rows.shape[0], 1)

    top_k = column(top_k, torch.long)
    top_p, min_p = column(top_p, rows.dtype), column(min_p, rows.dtype)
    if (
        not ((top_k > 0) & (top_k < vocab)).any()
        and bool((top_p >= 1.0).all())
        and bool((min_p <= 0.0).all())
    ):
        return probs  # nothing to filter (SGLang's defaults)
    sorted_p, order = rows.sort(dim=-1, descending=True)
    rank = torch.arange(vocab).unsqueeze(0)
    keep = (top_k <= 0) | (top_k >= vocab) | (rank < top_k)
    keep &= (top_p >= 1.0) | (sorted_p.cumsum(-1) - sorted_p <= top_p)
    keep &= sorted_p >= min_p * sorted_p[:, :1]
    keep[:, 0] = True
    kept = torch.zeros_like(keep).scatter(-1, order, keep)
    out = torch.where(kept, rows, torch.zeros((), dtype=rows.dtype))
    return out if probs.dim() == 2 else out.squeeze(0)
