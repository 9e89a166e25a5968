"""One system's run for bench/peers.py, as its own process tree (the harness counts all of it):

    python bench/peers_systems.py SYSTEM RESULT_JSON MARK_AT PASSES URL...

Each system reads the same shards PASSES times over, does peers_work.prepare on every sample and
delivers the result to a consumer, which counts it. Every consumer records (time.time(), samples)
at each delivery; the consumer that brings the count of delivered samples (all consumers of the
run together) to MARK_AT prints ``PEERS-MARK`` on stdout, and ``PEERS-END`` is printed when the
last consumer has finished: the harness snapshots the tree's CPU at both. The run writes
{"samples", "bytes", "events": [[time, samples delivered], ...]} to RESULT_JSON.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import peers_work

MARK, END = "PEERS-MARK", "PEERS-END"
MARK_AT = 1
"""The sample count at which PEERS-MARK is printed (argv)."""
BATCH = 16
"""Samples per batch where a peer batches (DataLoader, Ray, Energon)."""
ARENA_BYTES = 64 << 20
"""The floor's reused output buffer: more than any one sample's images."""


class Tally:
    """What a consumer received; ``shared`` (a multiprocessing Value) counts all of a run's
    consumers together where there are several (the floor's workers, disttrain's ranks)."""

    def __init__(self, shared=None, mark_at: int | None = None):
        self.samples, self.bytes, self.shared = 0, 0, shared
        self.mark_at = MARK_AT if mark_at is None else mark_at
        self.events: list[tuple[float, int]] = []

    def add(self, samples: int, nbytes: int) -> None:
        now = time.time()
        self.samples, self.bytes = self.samples + samples, self.bytes + nbytes
        self.events.append((now, samples))
        if self.shared is None:
            before = self.samples - samples
        else:
            with self.shared.get_lock():
                before = self.shared.value
                self.shared.value += samples
        if before < self.mark_at <= before + samples:
            print(MARK, flush=True)

    def as_dict(self) -> dict:
        return {"samples": self.samples, "bytes": self.bytes, "events": self.events}


def merged(tallies: list[dict]) -> dict:
    return {"samples": sum(t["samples"] for t in tallies), "bytes": sum(t["bytes"] for t in tallies),
            "events": sorted(e for t in tallies for e in t["events"])}


def end() -> None:
    print(END, flush=True)


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


# --- tar random access (the floor, tf.data) --------------------------------------------------------
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


def read_sample(entry, files: dict[str, int] | None = None) -> dict:
    """One sample's members by pread; ``files`` keeps the shards open across calls."""
    url, key, members = entry
    files = {} if files is None else files
    if url not in files:
        files[url] = os.open(url, os.O_RDONLY)
    sample = {"__key__": key, "__url__": url}
    for suffix, offset, size in members:
        sample[suffix] = os.pread(files[url], size, offset)
    return sample


# --- the floor: one bare process per core, no delivery ---------------------------------------------
def _floor_worker(entries: list, shared, results) -> None:
    import numpy as np

    _one_thread()
    arena, files, tally = np.empty(ARENA_BYTES, np.uint8), dict[str, int](), Tally(shared)
    for entry in entries:
        if (p := peers_work.prepare(read_sample(entry, files), "ours", arena)) is not None:
            tally.add(1, p.nbytes)
    results.put(tally.as_dict())


def run_floor(urls: list[str], passes: int) -> dict:
    """Every core decodes its share of the samples (sample i on core i mod cores) into one reused
    buffer with our decode path; nothing is delivered or copied."""
    import multiprocessing as mp

    from preprocess_service.adapters import decode  # noqa: F401 (imported once, before the fork)
    from preprocess_service.adapters.media import imaging, parse  # noqa: F401

    _one_thread()
    index = tar_index(urls) * passes
    cores = len(os.sched_getaffinity(0))
    ctx = mp.get_context("fork")
    shared, results = ctx.Value("q", 0), ctx.Queue()
    procs = [ctx.Process(target=_floor_worker, args=(index[r::cores], shared, results)) for r in range(cores)]
    for proc in procs:
        proc.start()
    tallies = [results.get() for _ in procs]
    end()
    for proc in procs:
        proc.join()
    return merged(tallies)


# --- disttrain: embedded service + 2 client ranks -------------------------------------------------
def _trainers(dp_size: int, job, results, shared, mark_at: int) -> None:
    """The trainer side: imports the client (and with it torch) once, forks the other ranks and is
    rank 0, as a DataLoader's workers fork from its trainer (a trainer imports torch whatever feeds it).
    It starts with the service, as a deployment's trainers and service do, and the ranks connect
    once the job is open."""
    import multiprocessing as mp

    import trainer  # noqa: F401

    address, job_id = job.recv()
    ctx = mp.get_context("fork")  # no gRPC channel exists in this process yet: forking is safe
    procs = [ctx.Process(target=_rank, args=(address, job_id, r, results, Tally(shared, mark_at)))
             for r in range(1, dp_size)]
    for proc in procs:
        proc.start()
    # This process is rank 0, as a DataLoader's trainer consumes.
    _rank(address, job_id, 0, results, Tally(shared, mark_at))
    for proc in procs:
        proc.join()


def _rank(address: str, job_id: str, rank: int, results, tally: Tally) -> None:
    from trainer import DataClient

    with DataClient(address, job_id, rank, prefetch=4) as client:
        for mb in client:
            tally.add(len(mb.sample_keys), mb.nbytes)
        results.put(tally.as_dict())


def run_disttrain(urls: list[str], passes: int, dp_size: int = 2) -> dict:
    import multiprocessing as mp

    from preprocess_service.adapters.decode import forkserver

    forkserver.start()  # as `serve` does: the decode workers' fork server imports while we do
    ctx = mp.get_context("spawn")
    results, shared, (job_recv, job_send) = ctx.Queue(), ctx.Value("q", 0), ctx.Pipe(duplex=False)
    launcher = ctx.Process(target=_trainers, args=(dp_size, job_recv, results, shared, MARK_AT))
    launcher.start()

    import grpc

    from disttrain_api.config import JobConfig
    from disttrain_tools.runner import CHANNEL_OPTIONS, pb, pb_grpc, spec_from_config
    from preprocess_service.service.server import create_server

    config = JobConfig(shards=tuple(urls), dp_size=dp_size, num_microbatches=4, seqs_per_microbatch=2,
                       num_epochs=passes)
    server, port, _ = create_server("127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            info = pb_grpc.PreprocessStub(channel).OpenJob(pb.OpenJobRequest(spec=spec_from_config(config)), timeout=60)
        job_send.send((address, info.job_id))
        ranks = [results.get(timeout=3600) for _ in range(dp_size)]
        end()
        launcher.join(timeout=60)
    finally:
        if launcher.is_alive():
            launcher.kill()
        server.stop(grace=1).wait()
    return merged(ranks)


# --- DataLoader(num_workers=2) + webdataset -------------------------------------------------------
def _dl_sample(sample, decoder):
    import torch

    p = peers_work.prepare(sample, decoder)
    if p is None:
        return {"skipped": True}
    return {"tokens": torch.from_numpy(p.tokens), "images": [torch.from_numpy(a) for a in p.images],
            "audio": [torch.from_numpy(a) for a in p.audio]}


def _keep_list(batch: list[dict]) -> list[dict]:
    """A batch as the list of its samples (their shapes differ): each worker sends one message per batch."""
    return batch


def _worker_init(_):
    _one_thread()


def _delivered(items: list[dict]) -> tuple[int, int]:
    """(samples, bytes) of delivered items, the skipped ones left out."""
    kept = [item for item in items if not item.get("skipped")]
    return len(kept), sum(i["tokens"].nbytes + sum(t.nbytes for t in i["images"] + i["audio"]) for i in kept)


def run_dataloader(urls: list[str], passes: int, decoder: str, batch_size: int | None) -> dict:
    import torch
    import webdataset as wds

    _one_thread()
    dataset = wds.WebDataset(urls * passes, shardshuffle=False, empty_check=False).map(
        functools.partial(_dl_sample, decoder=decoder))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=2, worker_init_fn=_worker_init,
                                         prefetch_factor=4, collate_fn=_keep_list if batch_size else None)
    tally = Tally()
    for item in loader:
        tally.add(*_delivered(item if batch_size else [item]))
    end()
    return tally.as_dict()


# --- tf.data service: dispatcher + worker in this process, consumer in another --------------------
TF_OUT = ("ok", "tokens", "pixels", "image_shapes", "audio", "audio_shapes")


def _tf_pipeline(urls: list[str], passes: int, decoder: str):
    """The same graph in the server and the consumer: the worker runs the consumer's serialized
    graph, whose py_function ("pyfunc_0") resolves in the worker's process to the function this
    process registered first; so both processes must build it identically and first."""
    import numpy as np
    import tensorflow as tf

    index, files = tar_index(urls) * passes, dict[str, int]()

    def work(i):
        p = peers_work.prepare(read_sample(index[int(i)], files), decoder)
        if p is None:
            return (False, np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros((0, 3), np.int32),
                    np.zeros(0, np.float32), np.zeros((0, 2), np.int32))
        flat = peers_work.flatten(p)
        return (True, *(flat[name] for name in TF_OUT[1:]))

    types = (tf.bool, tf.int32, tf.uint8, tf.int32, tf.float32, tf.int32)
    return tf.data.Dataset.range(len(index)).map(
        lambda i: tf.py_function(work, [i], types), num_parallel_calls=2).prefetch(4)


def run_tf_service(urls: list[str], passes: int, decoder: str) -> dict:
    import subprocess

    import tensorflow as tf

    _tf_pipeline(urls, passes, decoder)  # registers the py_function in this (the worker's) process
    dispatcher = tf.data.experimental.service.DispatchServer()
    address = dispatcher.target.split("://")[1]
    worker = tf.data.experimental.service.WorkerServer(  # noqa: F841 (serves while referenced)
        tf.data.experimental.service.WorkerConfig(dispatcher_address=address))
    out = Path(sys.argv[2]).with_suffix(".consumer.json")
    subprocess.run([sys.executable, __file__, f"tf-consumer-{decoder}", str(out), str(MARK_AT), str(passes),
                    address, *urls], check=True)
    return json.loads(out.read_text())


def run_tf_consumer(urls: list[str], passes: int, decoder: str) -> dict:
    import tensorflow as tf

    address = urls.pop(0)
    dataset = _tf_pipeline(urls, passes, decoder).apply(tf.data.experimental.service.distribute(
        processing_mode="parallel_epochs", service=f"grpc://{address}"))
    tally = Tally()
    for ok, *arrays in dataset.as_numpy_iterator():
        if ok:
            tally.add(1, sum(a.nbytes for a in arrays))
    end()
    return tally.as_dict()


# --- Ray Data: map_batches ------------------------------------------------------------------------
def _ray_batch(batch: dict, decoder: str) -> dict:
    """A batch of raw webdataset rows -> the flattened prepared samples (peers_work.flatten). Members
    a sample lacks come as None (the block's schema is the union of all samples')."""
    import numpy as np

    out: dict[str, list] = {name: [] for name in TF_OUT}
    for i in range(len(batch["__key__"])):
        sample = {k: (v[i] if k.startswith("__") else bytes(v[i])) for k, v in batch.items()
                  if isinstance(v[i], (bytes, bytearray, memoryview)) or (k.startswith("__") and isinstance(v[i], str))}
        p = peers_work.prepare(sample, decoder)
        flat = peers_work.flatten(peers_work.EMPTY if p is None else p)
        out["ok"].append(p is not None)
        for name in TF_OUT[1:]:
            out[name].append(flat[name])
    return {name: np.array(values) if name == "ok" else _ragged(values) for name, values in out.items()}


def _ragged(arrays: list):
    import numpy as np

    column = np.empty(len(arrays), dtype=object)
    column[:] = arrays
    return column


def run_ray(urls: list[str], passes: int, decoder: str) -> dict:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        dataset = ray.data.read_webdataset(urls * passes, decoder=None).map_batches(
            _ray_batch, fn_kwargs={"decoder": decoder}, batch_size=BATCH, batch_format="numpy")
        tally = Tally()
        for batch in dataset.iter_batches(batch_size=BATCH, batch_format="numpy"):
            ok = batch["ok"]
            tally.add(int(ok.sum()), sum(a.nbytes for name in ("tokens", "pixels", "audio")
                                         for a, kept in zip(batch[name], ok) if kept))
        end()
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


def run_energon(urls: list[str], passes: int) -> dict:
    """``urls`` is the prepared folder (see prepare_energon). Energon refuses a sample key seen twice,
    so the passes iterate its loader again (its workers persist across passes)."""
    from megatron.energon import Cooker, DefaultTaskEncoder, WorkerConfig, get_loader, get_val_dataset, stateless

    class Encoder(DefaultTaskEncoder):
        decoder = None  # raw bytes: the cooker does the work
        cookers = [Cooker(stateless(_energon_cook))]

        def batch(self, samples):
            return samples

    _one_thread()
    dataset = get_val_dataset(urls[0], split_part="train", batch_size=BATCH, task_encoder=Encoder(),
                              worker_config=WorkerConfig(rank=0, world_size=1, num_workers=2))
    tally, loader = Tally(), get_loader(dataset)
    for _ in range(passes):
        for batch in loader:
            tally.add(*_delivered(batch))
    end()
    return tally.as_dict()


SYSTEMS: dict[str, Callable[[list[str], int], dict | str]] = {
    "floor": run_floor,
    "disttrain": run_disttrain,
    "dl-ours": functools.partial(run_dataloader, decoder="ours", batch_size=BATCH),
    "dl-ours-nobatch": functools.partial(run_dataloader, decoder="ours", batch_size=None),
    "dl-pillow": functools.partial(run_dataloader, decoder="pillow", batch_size=BATCH),
    "dl-pillow-nodraft": functools.partial(run_dataloader, decoder="pillow-nodraft", batch_size=BATCH),
    "tf-pillow": functools.partial(run_tf_service, decoder="pillow"),
    "tf-ours": functools.partial(run_tf_service, decoder="ours"),
    "tf-consumer-pillow": functools.partial(run_tf_consumer, decoder="pillow"),
    "tf-consumer-ours": functools.partial(run_tf_consumer, decoder="ours"),
    "ray-pillow": functools.partial(run_ray, decoder="pillow"),
    "ray-ours": functools.partial(run_ray, decoder="ours"),
    "energon-pillow": run_energon,
    "energon-prepare": lambda args, passes: str(prepare_energon(args[1:], Path(args[0]))),
}

if __name__ == "__main__":
    system, result, mark_at, passes, *shard_urls = sys.argv[1:]
    MARK_AT = int(mark_at)
    Path(result).write_text(json.dumps(SYSTEMS[system](shard_urls, int(passes))))
