"""Files written and read without corruption, below every other layer (the checkpoint package,
the data writers and the tokenizer build on it; it imports nothing of bert_port). One job per
module, imports going down this list:

- `errors`: `CheckpointError`, the error of a folder that cannot be read or written, and its messages;
- `names`: the names of a checkpoint folder's files and of a staged write's own (pure);
- `bounded`: a folder's own small files read with a bound (never a FIFO or a device);
- `locking`: folder locks, exclusive for writes, shared for reads;
- `journal`: the commit journal of a staged write, and whether it still describes the folder;
- `staging`: staged all-or-nothing writes (`StagedWrite`, `atomic_write`), the clean-up of killed ones (`repair`).
"""
