"""Test helpers: a Hugging Face hub cache built by hand, and a W&B offline run log read back."""

from __future__ import annotations

import shutil
import struct

REV = "0123456789abcdef0123456789abcdef01234567"


def build_hub_cache(cache, repo_id, checkpoint):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<rev>/}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(checkpoint, repo / "snapshots" / REV)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return repo / "snapshots" / REV


def wandb_key(item):
    return item.key or "/".join(item.nested_key)  # W&B stores "eval/accuracy" as nested


def read_wandb_log(path):
    """The records of a W&B transaction log (``run-*.wandb``): a 7-byte header, then
    LevelDB-style 32 KiB blocks of chunks (crc, length, type) holding protobuf records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, chunk, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records
