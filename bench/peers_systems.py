"""One system's run for bench/peers.py, as its own process tree (the harness counts all of it):

    python bench/peers_systems.py SYSTEM RESULT_JSON URL...

Each system reads the same shards, does peers_work.prepare on every sample and delivers the
result to a consumer process, which counts it. The consumer prints ``PEERS-FIRST`` on stdout at
its first sample (the harness snapshots the tree's CPU then) and the run writes
{"samples", "bytes", "t_first", "t_last"} (time.time()) to RESULT_JSON.
"""

from __future__ import annotations

import json
import os
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_work

FIRST = "PEERS-FIRST"


class Tally:
    """What a consumer received."""

    def __init__(self):
        self.samples, self.bytes, self.t_first, self.t_last = 0, 0, None, None

    def add(self, samples: int, nbytes: int) -> None:
        now = time.time()
        if self.t_first is None:
            self.t_first = now
            print(FIRST, flush=True)
        self.samples, self.bytes, self.t_last = self.samples + samples, self.bytes + nbytes, now

    def as_dict(self) -> dict:
        return {"samples": self.samples, "bytes": self.bytes, "t_first": self.t_first, "t_last": self.t_last}


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


# --- the floor: one bare process ------------------------------------------------------------------
def run_floor(urls: list[str]) -> dict:
    from preprocess_service.adapters import shards

    _one_thread()
    tally = Tally()
    for url in urls:
        for sample in shards.iter_shard(url, lambda problem: None):
            if (p := peers_work.prepare(sample, "ours")) is not None:
                tally.add(1, p.nbytes)
    return tally.as_dict()


# --- disttrain: embedded service + 2 client ranks -------------------------------------------------
def _trainers(dp_size: int, job, results) -> None:
    """The trainer side: imports the client (and with it torch) once, forks the other ranks and is
    rank 0, as a DataLoader's workers fork from its trainer (a trainer imports torch whatever feeds it).
    It starts with the service, as a deployment's trainers and service do, and the ranks connect
    once the job is open."""
    import multiprocessing as mp

    import trainer  # noqa: F401

    address, job_id = job.recv()
    ctx = mp.get_context("fork")  # no gRPC channel exists in this process yet: forking is safe
    procs = [ctx.Process(target=_rank, args=(address, job_id, r, results)) for r in range(1, dp_size)]
    for proc in procs:
        proc.start()
    _rank(address, job_id, 0, results)  # this process is rank 0, as a DataLoader's trainer consumes
    for proc in procs:
        proc.join()


def _rank(address: str, job_id: str, rank: int, results) -> None:
    from trainer import DataClient

    tally = Tally()
    with DataClient(address, job_id, rank, prefetch=4) as client:
        for mb in client:
            tally.add(len(mb.sample_keys), mb.nbytes)
    results.put(tally.as_dict())


def run_disttrain(urls: list[str], dp_size: int = 2) -> dict:
    import multiprocessing as mp

    from preprocess_service.adapters import forkserver

    forkserver.start()  # as `serve` does: the decode workers' fork server imports while we do
    ctx = mp.get_context("spawn")
    results, (job_recv, job_send) = ctx.Queue(), ctx.Pipe(duplex=False)
    launcher = ctx.Process(target=_trainers, args=(dp_size, job_recv, results))
    launcher.start()

    import grpc

    from disttrain_api.config import JobConfig
    from preprocess_service.service.runner import CHANNEL_OPTIONS, pb, pb_grpc, spec_from_config
    from preprocess_service.service.server import create_server

    config = JobConfig(shards=tuple(urls), dp_size=dp_size, num_microbatches=4, seqs_per_microbatch=2)
    server, port, _ = create_server("127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            info = pb_grpc.PreprocessStub(channel).OpenJob(pb.OpenJobRequest(spec=spec_from_config(config)), timeout=60)
        job_send.send((address, info.job_id))
        ranks = [results.get(timeout=600) for _ in range(dp_size)]
        launcher.join(timeout=60)
    finally:
        if launcher.is_alive():
            launcher.kill()
        server.stop(grace=1).wait()
    return {"samples": sum(r["samples"] for r in ranks), "bytes": sum(r["bytes"] for r in ranks),
            "t_first": min(r["t_first"] for r in ranks), "t_last": max(r["t_last"] for r in ranks)}


# --- DataLoader(num_workers=2) + webdataset -------------------------------------------------------
def _dl_sample(sample, decoder):
    import torch

    p = peers_work.prepare(sample, decoder)
    if p is None:
        return {"skipped": True}
    return {"tokens": torch.from_numpy(p.tokens), "images": [torch.from_numpy(a) for a in p.images],
            "audio": [torch.from_numpy(a) for a in p.audio]}


def _worker_init(_):
    _one_thread()


def run_dataloader(urls: list[str], decoder: str) -> dict:
    import functools

    import torch
    import webdataset as wds

    _one_thread()
    dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False).map(
        functools.partial(_dl_sample, decoder=decoder))
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, worker_init_fn=_worker_init,
                                         prefetch_factor=4)
    tally = Tally()
    for item in loader:
        if not item.get("skipped"):
            tally.add(1, item["tokens"].nbytes + sum(t.nbytes for t in item["images"] + item["audio"]))
    return tally.as_dict()


# --- tf.data service: dispatcher + worker in this process, consumer in another --------------------
def tar_index(urls: list[str]) -> list[tuple[str, str, list[tuple[str, int, int]]]]:
    """(url, key, [(suffix, data offset, size)]) per sample, in tar order: random access by index."""
    index: list = []
    for url in urls:
        with tarfile.open(url) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, _, suffix = os.path.basename(member.name).partition(".")
                if not index or index[-1][:2] != (url, key):
                    index.append((url, key, []))
                index[-1][2].append((suffix, member.offset_data, member.size))
    return index


def read_sample(entry) -> dict:
    url, key, members = entry
    sample = {"__key__": key, "__url__": url}
    with open(url, "rb") as f:
        for suffix, offset, size in members:
            f.seek(offset)
            sample[suffix] = f.read(size)
    return sample


TF_OUT = ("ok", "tokens", "pixels", "image_shapes", "audio", "audio_shapes")


def _tf_pipeline(urls: list[str]):
    """The same graph in the server and the consumer: the worker runs the consumer's serialized
    graph, whose py_function ("pyfunc_0") resolves in the worker's process to the function this
    process registered first; so both processes must build it identically and first."""
    import numpy as np
    import tensorflow as tf

    index = tar_index(urls)

    def work(i):
        p = peers_work.prepare(read_sample(index[int(i)]), "pillow")
        if p is None:
            return (False, np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros((0, 3), np.int32),
                    np.zeros(0, np.float32), np.zeros((0, 2), np.int32))
        flat = peers_work.flatten(p)
        return (True, *(flat[name] for name in TF_OUT[1:]))

    types = (tf.bool, tf.int32, tf.uint8, tf.int32, tf.float32, tf.int32)
    return tf.data.Dataset.range(len(index)).map(
        lambda i: tf.py_function(work, [i], types), num_parallel_calls=2).prefetch(4)


def run_tf_service(urls: list[str]) -> dict:
    import subprocess

    import tensorflow as tf

    _tf_pipeline(urls)  # registers the py_function in this (the worker's) process
    dispatcher = tf.data.experimental.service.DispatchServer()
    address = dispatcher.target.split("://")[1]
    worker = tf.data.experimental.service.WorkerServer(  # noqa: F841 (serves while referenced)
        tf.data.experimental.service.WorkerConfig(dispatcher_address=address))
    out = Path(sys.argv[2]).with_suffix(".consumer.json")
    subprocess.run([sys.executable, __file__, "tf-consumer", str(out), address, *urls], check=True)
    return json.loads(out.read_text())


def run_tf_consumer(urls: list[str]) -> dict:
    import tensorflow as tf

    address = urls.pop(0)
    dataset = _tf_pipeline(urls).apply(tf.data.experimental.service.distribute(
        processing_mode="parallel_epochs", service=f"grpc://{address}"))
    tally = Tally()
    for ok, *arrays in dataset.as_numpy_iterator():
        if ok:
            tally.add(1, sum(a.nbytes for a in arrays))
    return tally.as_dict()


# --- Ray Data -------------------------------------------------------------------------------------
def _ray_row(row: dict) -> dict:
    # Members a sample lacks come as None/NaN (the block's schema is the union of all samples').
    sample = {k: (v if k.startswith("__") else bytes(v)) for k, v in row.items()
              if isinstance(v, (bytes, bytearray, memoryview)) or (k.startswith("__") and isinstance(v, str))}
    p = peers_work.prepare(sample, "pillow")
    if p is None:
        return {"ok": False, **{k: v for k, v in peers_work.flatten(peers_work.EMPTY).items() if k != "key"}}
    flat = peers_work.flatten(p)
    flat.pop("key")
    return {"ok": True, **flat}


def run_ray(urls: list[str]) -> dict:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        dataset = ray.data.read_webdataset(urls, decoder=None).map(_ray_row)
        tally = Tally()
        for row in dataset.iter_rows():
            if row["ok"]:
                tally.add(1, sum(row[k].nbytes for k in ("tokens", "pixels", "audio")))
    finally:
        ray.shutdown()
    return tally.as_dict()


# --- Megatron-Energon: CrudeWebdataset + a cooker, its loader with 2 workers ------------------------
def prepare_energon(urls: list[str], root: Path) -> Path:
    """The metadata energon needs (``energon prepare``: .nv-meta/ with a sample index), made once
    before the rounds on a folder of links to the shards, one split holding them all."""
    import subprocess

    root.mkdir(parents=True, exist_ok=True)
    for i, url in enumerate(urls):
        (root / f"{i:05d}.tar").symlink_to(url)
    energon = Path(sys.executable).parent / "energon"
    subprocess.run([str(energon), "prepare", str(root), "--non-interactive", "--split-ratio", "1,0,0",
                    "--sample-type", "CrudeWebdataset", "--no-progress"], check=True, capture_output=True)
    return root


def _energon_cook(sample: dict) -> dict:
    raw = {k: v for k, v in sample.items() if isinstance(v, bytes) or k in ("__key__",)}
    return _dl_sample(raw, "pillow")


def run_energon(urls: list[str]) -> dict:
    from megatron.energon import Cooker, DefaultTaskEncoder, WorkerConfig, get_loader, get_val_dataset, stateless

    class Encoder(DefaultTaskEncoder):
        decoder = None  # raw bytes: the cooker does the work
        cookers = [Cooker(stateless(_energon_cook))]

        def batch(self, samples):
            return samples

    _one_thread()
    dataset = get_val_dataset(urls[0], split_part="train", batch_size=1, task_encoder=Encoder(),
                              worker_config=WorkerConfig(rank=0, world_size=1, num_workers=2))
    tally = Tally()
    for batch in get_loader(dataset):
        for item in batch:
            if not item.get("skipped"):
                tally.add(1, item["tokens"].nbytes + sum(t.nbytes for t in item["images"] + item["audio"]))
    return tally.as_dict()


SYSTEMS = {
    "floor": run_floor,
    "disttrain": run_disttrain,
    "dl-ours": lambda urls: run_dataloader(urls, "ours"),
    "dl-pillow": lambda urls: run_dataloader(urls, "pillow"),
    "tf-service": run_tf_service,
    "tf-consumer": run_tf_consumer,
    "ray": run_ray,
    "energon": run_energon,
    "energon-prepare": lambda args: str(prepare_energon(args[1:], Path(args[0]))),
}

if __name__ == "__main__":
    system, result, *shard_urls = sys.argv[1:]
    Path(result).write_text(json.dumps(SYSTEMS[system](shard_urls)))
