"""Training checkpoints: resume a run exactly, atomically, at the same or another parallel layout.

- `save`, `load`: writing and resuming a checkpoint (`load_weights`: the model alone, for tools);
- `steps`: which checkpoints a root holds (`latest`, step directories) and the layout that wrote each;
- `dist`: model and optimizer state through megatron's `dist_checkpointing`;
- `files`, `meta`: durable checksummed files, `meta.json` and the verification of both;
- `rng_state`, `schedule`, `resume_checks`: RNG streams, which steps are saved, what a resume must share;
- `source`: what a tool was pointed at (HF checkpoint, training checkpoint or run directory).

Layout of a checkpoint root::

    root/
      latest                  name of the newest complete checkpoint directory (one line)
      step_00000003/
        meta.json             step, weight_version, parallel layout, scheduler state, Adam step,
                              whether optimizer state was saved (not before the first step),
                              versions, every file's size and SHA-256, and meta.json's own checksum
        trainer_state.pt      the trainer's own state (data position, running stats, counters, config)
        rank_00000.pt         this rank's RNG streams
        rank_00001.pt
        dist/                 model and optimizer: megatron `dist_checkpointing` (torch_dist),
                              written fully parallel (see `checkpoint.dist`)
        model/                config.json (HF form) and the run's tokenizer, for `megatron-gspo export`

Resharding: model weights and optimizer state (Adam moments, fp32 main params, step) are
stored per global tensor, so a checkpoint written at TP2 resumes at EP2, at TP1 x EP1, or at
any other layout of the same model; only the optimizer kind (distributed or not) must match.
The exception is the distributed optimizer's routine save (`reshardable=False`): its state is
each rank's slice of megatron's flat buffers (`dp_reshardable`), written without the gather
into host memory that a reshardable save costs, and it loads only at the layout that wrote it;
another layout is refused (`CheckpointLayoutError`) in favour of a reshardable checkpoint,
the newest of which `keep_last` never deletes.
RNG streams are per rank and only restored at the same layout (world size, TP, EP, ETP, DP);
at another layout the run keeps the streams it was seeded with, and says so.

Atomicity: all ranks write into a fresh `step_N.tmp-<random>/` directory and fsync their
files; once every rank has succeeded, rank 0 renames the directory to `step_N/` and then
replaces `latest` through a temporary file and `os.replace`. A crash at any point leaves
`latest` naming either the previous complete checkpoint or the new one; directories a crash
left behind are removed by the next save.

Integrity: the checksums of our own files are computed while they are written; megatron's
files under `dist/` are read back after the save (from the page cache), each rank hashing
and fsyncing a share of them. Loading verifies every file before any state is touched: each
rank its own RNG file (rank 0 also the trainer state) and a share of `dist/`, so every file
is checked by one rank. A damaged file is named. With `fallback=True` (what `--resume` uses)
a damaged checkpoint is skipped with a warning for the newest older intact one, `latest`
is pointed at it and the damaged one is moved aside (`step_N.damaged-<hex>`, never deleted,
never counted by `keep_last`); only when none is intact does loading fail, listing what was
wrong with each.
"""
