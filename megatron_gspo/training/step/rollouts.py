"""Rollout stage of an RL step: prompts -> one batched /generate per server -> validated, scored batch.

Only global rank 0 talks to the rollout engine. A step's prompts go out as one SGLang batch
request per server (`input_ids` as a list of lists, per-row sampling params), which the
engines batch far better than many single requests. Every row carries its own
`sampling_seed` derived from (run seed, step, row), so a step's rollouts are reproducible,
which an exact resume needs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from megatron_gspo.config import RolloutConfig
from megatron_gspo.rollout import (
    RolloutBatch,
    RolloutSample,
    RolloutValidationError,
    SGLangClient,
    build_generate_request,
    launch_embedded_server,
    parse_generate_response,
)
from megatron_gspo.rollout.partial import PartialRollouts, segments_of
from megatron_gspo.rollout.sglang_launch import launch_sglang_server
from megatron_gspo.tasks import Problem, Task
from megatron_gspo.tasks.tokenizer import problem_prompt_ids
from megatron_gspo.training.ahead.staleness import check_not_older

logger = logging.getLogger(__name__)

EVAL_SEED_SALT = 0x4E1D_E7A1
"""Mixed into the run seed for held-out sampling, so its seeds are not the training steps'."""
SERVER_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""`rollout.dtype` -> the embedded server's --dtype (SGLang's names)."""


def sampling_seeds(seed: int, step: int, rows: int) -> list[int]:
    """62-bit sampling seeds of a step's rows; row r's depends only on (run seed, step, r).

    One `SeedSequence` per step: word i of `generate_state` does not depend on how many
    words are drawn, so row r always gets words 2r and 2r + 1.
    """
    words = np.random.SeedSequence([seed, step]).generate_state(2 * rows, dtype=np.uint32)
    pairs = words.reshape(rows, 2).astype(np.int64)
    return ((pairs[:, 0] << 30) ^ pairs[:, 1]).tolist()


def sample_rows(scored: Sequence[tuple], n: int, group_size: int) -> list[dict]:
    """`n` of a step's (problem, completion, reward[, extra fields]) as log rows: one per group first."""
    order = sorted(range(len(scored)), key=lambda i: (i % group_size, i))
    return [
        {"prompt": scored[i][0].prompt, "answer": scored[i][0].answer, "completion": scored[i][1],
         "reward": scored[i][2], **(scored[i][3] if len(scored[i]) > 3 else {})}
        for i in order[:n]
    ]  # fmt: skip


class RolloutEngine:
    """Rank 0's handle on the rollout servers: sample scored groups, greedy completions, weight sync.

    Args:
        client: connected to the servers.
        task: supplies rewards.
        tokenizer: encodes prompts and decodes completions.
        cfg: sampling and validation settings.
        vocab_size: the policy's vocabulary (token ids are checked against it).
        add_bos: prepend BOS to prompts.
        routed_experts: (layers, k, experts): ask for and validate routed experts (R3, drift).
        samples_per_step: (prompt, completion, reward) rows a batch keeps in `stats["sample_rows"]`.
    """

    def __init__(self, client: SGLangClient, task: Task, tokenizer, cfg: RolloutConfig, *, vocab_size: int,
                 add_bos: bool = True, routed_experts: tuple[int, int, int] | None = None,
                 samples_per_step: int = 0):  # fmt: skip
        self.client, self.task, self.tokenizer, self.cfg = client, task, tokenizer, cfg
        self.vocab_size = vocab_size
        self.add_bos = add_bos
        self.routed_experts = routed_experts
        self.samples_per_step = samples_per_step
        self.partial: PartialRollouts | None = None  # rollout.update_mode=partial: responses span syncs
        # Rollouts ahead (drain): told when a batch's responses are in, so a weight sync need not
        # wait for their checks and scoring.
        self.on_responses: Callable[[], None] | None = None

    def prompt_ids(self, problem: Problem) -> list[int]:
        """Token ids of a prompt (BOS first when configured; the task's chat-template choice)."""
        return problem_prompt_ids(
            self.tokenizer, problem, add_bos=self.add_bos, chat_template=self.task.chat_template
        )

    def completion_text(self, sample: RolloutSample) -> str:
        """The decoded response without special tokens."""
        return self.tokenizer.decode(sample.response_ids.tolist(), skip_special_tokens=True)

    def sample_groups(
        self,
        problems: Sequence[Problem],
        *,
        seed: int,
        step: int,
        weight_version: int,
        routed_experts: bool = True,
    ) -> RolloutBatch:
        """G responses per problem from the engine, validated and scored.

        Args:
            problems: the step's prompts.
            seed: run seed (sampling seeds derive from it, the step and the row).
            step: RL step number.
            weight_version: the version the engine must report (when `check_weight_version`).
            routed_experts: ask for routed experts this step (only when the engine has their
                layout): the servers' answers grow by layers x k ids per token, so steps that
                neither replay (R3) nor measure drift leave them out.

        Returns:
            A batch whose `rewards` are filled (`Task.score_rows`, the whole batch at once); its
            `stats` add `unparseable_samples`, `reward_s` (seconds scoring), `task_metrics` (the
            task's own, e.g. `reward/code_*`), `no_answer_frac` (scored completions without an
            answer, `Task.has_answer`) and
            `sample_rows` (`samples_per_step` rows spread over the groups, for the samples log, with
            the task's own fields: `Task.score_rows`).

        Raises:
            RolloutValidationError: a bad response with `on_invalid=raise`, or no group left.
        """
        g = self.cfg.group_size
        seeds = sampling_seeds(seed, step, len(problems) * g)
        routing = self.routed_experts if routed_experts else None
        bodies, prompts = [], []
        for p, problem in enumerate(problems):
            ids = self.prompt_ids(problem)
            for j in range(g):
                row = p * g + j
                params = {
                    "max_new_tokens": self.cfg.max_new_tokens,
                    "temperature": self.cfg.temperature,
                    "top_p": self.cfg.top_p,
                    "top_k": self.cfg.top_k,
                    "sampling_seed": seeds[row],
                }
                bodies.append(
                    build_generate_request(
                        ids,
                        params,
                        rid=f"step{step}-p{p}-r{j}",
                        return_routed_experts=bool(routing),
                        check_sampling_params=row == 0,  # the rows differ only in their seeds
                        vocab_size=self.vocab_size if j == 0 else None,  # one prompt, G rows
                    )
                )
                prompts.append(ids)
        generate = self.partial.generate if self.partial is not None else self.client.generate_batched
        responses = generate(bodies)
        if self.on_responses is not None:
            self.on_responses()
        samples, unparseable, texts, extras = [], 0, [], []
        for row, (ids, body, response) in enumerate(zip(prompts, bodies, responses)):
            try:
                layout = dict(zip(("num_layers", "topk", "num_experts"), routing or ()))
                sample = parse_generate_response(
                    ids,
                    response,
                    vocab_size=self.vocab_size,
                    rid=body["rid"],
                    expect_routed_experts=bool(routing),
                    allow_mixed_versions=self.cfg.update_mode != "drain",  # a sync can land mid-response
                    **layout,
                )
                if "segments" in response:  # partial: the merged response's; else the server's spans
                    sample.segments = segments_of(response)
                if self.cfg.update_mode != "drain" and self.cfg.check_weight_version:
                    check_not_older(sample, weight_version)  # versions span syncs, never go back
            except RolloutValidationError:
                if self.cfg.on_invalid == "raise":
                    raise
                unparseable += 1  # its group becomes incomplete and is dropped with it
                continue
            sample.group_index = row // g
            samples.append(sample)
            texts.append(self.completion_text(sample))
            extra = {"segments": response["segments"]} if "segments" in response else {}
            if not extra and sample.segments is not None and len(sample.segments) > 1:
                extra = {"segments": [s.to_json() for s in sample.segments]}  # pause: spans a sync
            if extra:  # what shows its segments tile the response and its routes cover every position
                extra["response_tokens"] = sample.response_length
                if sample.routed_experts is not None:  # rows for positions 0 .. P + R - 2
                    extra["prompt_tokens"] = sample.prompt_length
                    extra["routed_positions"] = int(sample.routed_experts.shape[0])
            extras.append(extra)
        scored_problems = [problems[sample.group_index] for sample in samples]
        start = time.perf_counter()
        # the whole batch at once; a task's per-row fields (code: outcome, first failure) go to samples.jsonl
        rewards, task_metrics, row_fields = self.task.score_rows(scored_problems, texts)
        reward_s = time.perf_counter() - start
        extras = [{**fields, **extra} for fields, extra in zip(row_fields, extras, strict=True)]
        for sample, reward in zip(samples, rewards, strict=True):
            sample.reward = float(reward)
        no_answer = sum(not self.task.has_answer(text) for text in texts)
        rows = list(zip(scored_problems, texts, (s.reward for s in samples), extras))
        one_version = self.cfg.check_weight_version and self.cfg.update_mode == "drain"  # else spans syncs
        batch = RolloutBatch.from_samples(
            samples,
            g,
            expected_weight_version=str(weight_version) if one_version else None,
            on_invalid=self.cfg.on_invalid,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        batch.stats["unparseable_samples"] = unparseable
        batch.stats["no_answer_frac"] = no_answer / max(len(samples), 1)
        batch.stats["reward_s"] = reward_s
        batch.stats["task_metrics"] = task_metrics
        batch.stats["sample_rows"] = sample_rows(rows, self.samples_per_step, g)
        return batch

    def greedy_completions(self, problems: Sequence[Problem]) -> list[str]:
        """One greedy completion per problem (held-out evaluation)."""
        params = {"max_new_tokens": self.cfg.max_new_tokens, "temperature": 0.0}
        bodies = [
            build_generate_request(
                self.prompt_ids(p), params, return_logprob=False, rid=f"eval-{i}", vocab_size=self.vocab_size
            )
            for i, p in enumerate(problems)
        ]
        responses = self.client.generate_batched(bodies)
        return [self.tokenizer.decode(r["output_ids"], skip_special_tokens=True) for r in responses]

    def sampled_completions(
        self, problems: Sequence[Problem], n: int, *, temperature: float, seed: int
    ) -> list[list[str]]:
        """`n` sampled completions per problem (held-out pass@k), [len(problems)][n].

        The seeds depend only on (run seed, row), not on the step: every evaluation of a run
        draws with the same seeds, so its pass@k moves with the policy, not with the draw.
        """
        params = {"max_new_tokens": self.cfg.max_new_tokens, "temperature": temperature,
                  "top_p": self.cfg.top_p, "top_k": self.cfg.top_k}  # fmt: skip
        seeds = sampling_seeds(seed ^ EVAL_SEED_SALT, 0, len(problems) * n)
        bodies = []
        for p, problem in enumerate(problems):
            ids = self.prompt_ids(problem)
            for j in range(n):
                row_params = {**params, "sampling_seed": seeds[p * n + j]}
                vocab = self.vocab_size if j == 0 else None  # one prompt, n rows
                bodies.append(
                    build_generate_request(
                        ids, row_params, return_logprob=False, rid=f"eval-p{p}-s{j}", vocab_size=vocab
                    )
                )
        responses = self.client.generate_batched(bodies)
        texts = [self.tokenizer.decode(r["output_ids"], skip_special_tokens=True) for r in responses]
        return [texts[p * n : (p + 1) * n] for p in range(len(problems))]


def router_options(cfg: RolloutConfig) -> dict:
    """The client's router settings of `cfg` (none without `rollout.router_url`)."""
    if cfg.router_url is None:
        return {}
    return {
        "router_url": cfg.router_url,
        "min_workers": cfg.min_workers,
        "max_concurrency": cfg.router_max_in_flight,
    }


def embedded_server_count(cfg: RolloutConfig, devices_per_node: int) -> int:
    """Embedded servers a run starts: colocated, one per `server_tensor_parallel` devices of its node."""
    return devices_per_node // cfg.server_tensor_parallel if cfg.placement == "colocated" else 1


def sglang_server_args(
    cfg: RolloutConfig, *, weight_version: int, seed: int, routed_experts: bool
) -> list[str]:
    """`sglang.launch_server` arguments of a run's own SGLang server (rollout.engine=sglang).

    A colocated run's servers get SGLang's memory saver where there is CUDA; torch_memory_saver
    needs it, so on SGLang's CPU engine release and resume are no-ops (nothing is freed).
    """
    import torch

    args = ["--weight-version", str(weight_version), "--random-seed", str(seed)]
    args += ["--enable-memory-saver"] if cfg.placement == "colocated" and torch.cuda.is_available() else []
    args += ["--dtype", SERVER_DTYPES[cfg.dtype], "--skip-server-warmup"]
    args += ["--enable-return-routed-experts"] if routed_experts else []
    args += ["--enable-deterministic-inference"] if cfg.deterministic_inference else []
    return args + list(cfg.sglang_args)


def start_sglang_server(
    stack: contextlib.ExitStack, cfg: RolloutConfig, model_dir, log_path: Path, args: Sequence[str]
) -> str:
    """Start one real SGLang server for the run (stopped when `stack` closes); returns its URL."""
    import torch

    server = stack.enter_context(
        launch_sglang_server(
            model_dir,
            log_path=log_path,
            device="cuda" if torch.cuda.is_available() else "cpu",
            max_total_tokens=cfg.sglang_max_total_tokens,
            extra_args=args,
            num_threads=cfg.server_threads,
            timeout=cfg.server_start_timeout_s,
        )
    )
    logger.info("SGLang server on %s serving %s (log %s)", server.url, model_dir, server.log_path)
    return server.url


def start_embedded_server(
    stack: contextlib.ExitStack,
    cfg: RolloutConfig,
    model_dir,
    placed: Sequence[str],
    weight_version: int,
    seed: int,
) -> str:
    """Start one embedded server for the run (stopped when `stack` closes); returns its URL."""
    args = ["--weight-version", str(weight_version), "--seed", str(seed), *placed]
    server = stack.enter_context(
        launch_embedded_server(
            model_dir,
            extra_args=(*args, "--dtype", SERVER_DTYPES[cfg.dtype]),
            num_threads=cfg.server_threads,
            timeout=cfg.server_start_timeout_s,
            enable_memory_saver=cfg.placement == "colocated",
        )
    )
    logger.info("embedded rollout server on %s serving %s", server.url, model_dir)
    return server.url


@contextlib.contextmanager
def rollout_servers(
    cfg: RolloutConfig,
    model_dir: str | Path | None,
    *,
    weight_version: int,
    seed: int,
    log_dir: Path,
    routed_experts: bool = False,
) -> Iterator[SGLangClient]:
    """A client for the configured servers, or for `rollout.engine` servers started on `model_dir`.

    Servers given by URL serve what they were launched with; the trainer syncs its weights
    to them when those differ (`Trainer._startup_weights`). Servers the run starts are stopped on
    exit: real SGLang ones (rollout.engine=sglang) log to `log_dir`, return routed experts when
    the run replays them (`routed_experts`); embedded ones of a colocated run (one per
    `server_tensor_parallel` devices of the node) are launched with the memory saver, as SGLang's
    must be.
    """
    with contextlib.ExitStack() as stack:
        urls = list(cfg.server_urls)
        if not urls and cfg.router_url is None:
            count = embedded_server_count(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
            tp = cfg.server_tensor_parallel
            if cfg.placement == "colocated":  # server i spans devices [i * tp, (i + 1) * tp)
                layout = [("--tp-size", str(tp), "--base-gpu-id", str(i * tp)) for i in range(count)]
            else:
                layout = [()] * count
            sglang = cfg.engine == "sglang"
            args = (
                sglang_server_args(
                    cfg, weight_version=weight_version, seed=seed, routed_experts=routed_experts
                )
                if sglang
                else []
            )
            for index, placed in enumerate(layout):
                if sglang:
                    log_path = log_dir / f"server-{index}.log"
                    urls.append(start_sglang_server(stack, cfg, model_dir, log_path, [*args, *placed]))
                else:
                    urls.append(start_embedded_server(stack, cfg, model_dir, placed, weight_version, seed))
        client = stack.enter_context(
            SGLangClient(
                urls,
                timeout_s=cfg.request_timeout_s,
                max_retries=cfg.max_retries,
                batch_timeout_s=cfg.batch_timeout_s,
                **router_options(cfg),
            )
        )
        client.wait_until_healthy(cfg.server_start_timeout_s)
        yield client
