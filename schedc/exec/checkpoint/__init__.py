"""Checkpoints that lose nothing: complete or absent, verified before use, safe to load.

    DIR/step_00000040/      one checkpoint: torch.distributed.checkpoint files + meta.json
                            (+ meta.json.hmac when saved with --checkpoint-key)
    DIR/latest              the name of the newest complete checkpoint

What is saved (state.py): every parameter and its AdamW state, the step (which fixes the
learning rate and the data position: step s reads global batch s), and each rank's RNG
state. FSDP saves each unit's shards as DTensors, so a resume at another world size lets
DCP reshard them.

Complete or absent (save, here): a checkpoint is written into a hidden temporary directory,
hashed (meta.json lists the SHA-256 of every file), fsynced, renamed into place, and only
then named by `latest` (written by rename too). A crash at any point leaves the previous
checkpoint untouched.

What the hashes promise: the SHA-256 list detects corruption and truncation, not
tampering. It lives in meta.json beside the files it covers, so whoever can write the
directory can rewrite a tensor file and its hash, and without a key that is undetectable.
Tamper evidence needs a secret: with `--checkpoint-key FILE` (16 to 4096 bytes, e.g.
`head -c 32 /dev/urandom > FILE`), save writes meta.json.hmac, the HMAC-SHA256 of
meta.json's exact bytes, and load checks it before reading anything else; since
meta.json holds every file's hash, the HMAC covers every byte. A key proves that a
holder of the key wrote that checkpoint, not that it is the newest one. A checkpoint
that has meta.json.hmac is refused without a key (never loaded unchecked); a key and no
meta.json.hmac is refused too.

Loading (load, here) never runs code from the checkpoint, keyed or not. Nothing read is
trusted before it is checked, in this order: `latest` (a bounded read; it must name a
direct child step_NNNNNNNN: files.py), the HMAC over meta.json's bytes when a key is given,
meta.json's schema, every listed file's hash (regular files only, opened without following
links: meta_json.py), then DCP's .metadata: its bytes against their hash, unpickled with an
exact allowlist (unpickler.py), and its structure checked: tensors only, keys schedc
writes, storage in the checkpoint's own hashed files (dcp_metadata.py). Every failure is a
CheckpointError naming the file.
"""
