"""Read a run's metrics back with each tracker's own reader (TensorBoard's event accumulator,
MLflow's client, W&B's record protobufs), never with nemo_sspo code."""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK, _HEADER = 32768, 7  # the .wandb file is a LevelDB-style log of wandb_internal_pb2.Record


def wandb_records(run_dir: Path):
    """The protobuf records of the ``.wandb`` file in an offline run folder, in order."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks = _HEADER, []  # the file header fills the first 7 bytes of block 0
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER]) if left >= _HEADER else (0, 0, 0)
        if kind == 0:  # block trailer padding
            pos += left
            continue
        chunks.append(data[pos + _HEADER:pos + _HEADER + length])
        pos += _HEADER + length
        if kind in (1, 4):  # FULL or LAST chunk of a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def wandb_history(run_dir: Path) -> tuple[list[dict], dict]:
    """(history rows as ``{key: decoded JSON value}``, the run's config as ``{key: value}``)."""
    rows, config = [], {}
    for record in wandb_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif kind in ("run", "config"):
            items = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in items})
    return rows, config


def tensorboard_scalars(log_dir: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of one scalar tag in TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(key)]


def mlflow_runs(output_dir: Path, experiment: str = "nemo_sspo"):
    """(client, runs of ``experiment``) in the default local store of ``output_dir``."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{output_dir.resolve() / 'mlflow.db'}")
    return client, client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
