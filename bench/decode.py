"""Decode throughput, in one run on the same files: image paths, the decode stage vs a bare loop,
worker scaling, and the service end to end vs a PyTorch DataLoader.

    python bench/decode.py [--shards SPEC ...] [--max-docs 240] [--quick] [--json FILE]
    python bench/decode.py --only tokenizers [--tokenizer hf:PATH ...]   # part 4 alone

1. image paths (one core): every way to turn the same JPEGs into the planned target size, in
   images/s; the service uses the fastest robust one.
2. decode stage per modality (image documents, audio documents, generation targets, the mixed
   data as it comes): samples/s of
     bare      a plain loop in one process calling the same decode operations (decode.decode_item:
               simplejpeg/Pillow + torch resize, soundfile + torch resample and log-mel) on every member,
     1 worker  the service's decode stage: microbatch layout, DecodePool(1) (encoded bytes and
               results through shared memory), two microbatches in flight, as a stream runs it,
     2 workers the same with DecodePool(2);
   targets: 1 worker >= 0.9 x bare, 2 workers >= 1.8 x 1 worker. Each group is cycled up to
   --max-docs documents (steady state, not start-up and tail), and the arms run interleaved for
   --rounds rounds, best of each kept: the host's noise only ever slows a pass down. Beside them:
     bare x2   two plain processes running the bare loop at the same time, no pool: the scaling
               two cores of this machine give these operations, which bounds 2 workers / 1 worker;
     2w/x2     the pool's 2 workers against it (1.0 = the pool loses nothing to its plumbing);
     parent    the pool's own CPU in the parent (layout, copies into shared memory, dispatch),
               ms per document;
   and the machine's ceiling for pure compute in the same run, a Python loop in 2 processes / 1.
3. end to end: the service (embedded, default decode workers, one client process receiving
   torch tensors over gRPC) vs torch.utils.data.DataLoader(num_workers=2) over webdataset doing the
   same parsing and decoding per sample; samples/s of the whole demo epoch. Target >= 1.0x.
4. tokenizers: captions per CPU-second (one thread: RAYON_NUM_THREADS=1) of the byte tokenizer,
   a byte-level BPE tokenizer.json and a unigram sentencepiece model (at most 8,000 pieces, trained
   here on half of 20,000 LAION-like synthetic captions, measured on all of them) and any
   ``--tokenizer`` given; one text per call (``encode``) and 1,024 per call (``encode_batch``, the
   service's path), with the mean tokens per caption.
Machines here are noisy: compare figures from one run only. ``--quick`` is a smoke run (one shard of
40 synthetic samples, 16 documents per modality, one round, 500 captions), not a measurement.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))  # benchjson, when loaded from a test rather than run

import benchjson  # noqa: E402
import simplejpeg  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from disttrain_api.config import JobConfig  # noqa: E402
from disttrain_api.errors import SampleError  # noqa: E402
from disttrain_tools.jobs import ensure_demo_dataset  # noqa: E402
from preprocess_service.adapters.decode import DecodePool, decode_item  # noqa: E402
from preprocess_service.adapters.io import shards  # noqa: E402
from preprocess_service.adapters.media import imaging  # noqa: E402
from preprocess_service.adapters.media.parse import parse_document  # noqa: E402
from preprocess_service.core.assemble import layout_microbatch  # noqa: E402
from preprocess_service.core.packing import PackedSequence  # noqa: E402
from preprocess_service.core.sample import GenImageRef, ImageRef  # noqa: E402
from preprocess_service.core.tokenizer import ByteTokenizer  # noqa: E402

TOKENIZER = ByteTokenizer()
DOCS_PER_MICROBATCH = 16


def load_documents(urls: list[str], config: JobConfig) -> list:
    """Every document that parses and decodes (the corrupt ones are left out: they would be timed
    as failures in one path and not the other)."""
    docs = []
    for url in urls:
        for sample in shards.iter_shard(url, lambda problem: None):
            try:
                doc = parse_document(sample, image_config=config.image, tokenizer=TOKENIZER,
                                     seq_len=config.seq_len, audio_config=config.audio, generation=config.generation)
            except SampleError:
                continue
            if _decodes(doc):
                docs.append(doc)
    return docs


def _decodes(doc) -> bool:
    try:
        _decode_document(doc)
    except Exception:
        return False
    return True


# --- 1. image paths -------------------------------------------------------------------------------
def _torch_resize(pixels, hw):
    return imaging.resize(pixels, hw)


def _pil_resize(pixels, hw):
    if pixels.shape[:2] == hw:
        return pixels
    return np.asarray(Image.fromarray(pixels).resize((hw[1], hw[0]), Image.Resampling.BICUBIC))


def _pil_decode(data, hw, draft):
    with Image.open(io.BytesIO(data)) as img:
        if draft:
            img.draft("RGB", (hw[1], hw[0]))
        return np.array(img.convert("RGB"))


IMAGE_PATHS = {
    "Pillow full decode + Pillow bicubic": lambda d, hw: _pil_resize(_pil_decode(d, hw, False), hw),
    "Pillow draft + Pillow bicubic (previous path)": lambda d, hw: _pil_resize(_pil_decode(d, hw, True), hw),
    "Pillow draft + torch bicubic": lambda d, hw: _torch_resize(_pil_decode(d, hw, True), hw),
    "simplejpeg DCT-scaled + Pillow bicubic": lambda d, hw: _pil_resize(
        simplejpeg.decode_jpeg(d, colorspace="RGB", min_height=hw[0], min_width=hw[1]), hw),
    "simplejpeg DCT-scaled + torch bicubic (service)": lambda d, hw: imaging.decode_image(d, hw, 1),
}


def bench_image_paths(docs, repeats: int = 2, max_images: int = 200) -> dict[str, float]:
    jpegs = [(doc.media_bytes[img.member], (img.height, img.width)) for doc in docs for img in doc.images
             if img.orientation == 1 and doc.media_bytes[img.member][:3] == b"\xff\xd8\xff"][:max_images]
    out = {}
    for name, fn in IMAGE_PATHS.items():
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            for data, hw in jpegs:
                fn(data, hw)
            best = max(best, len(jpegs) / (time.perf_counter() - start))
        out[name] = best
    simd = "post" in Image.__version__  # pillow-simd versions read like 9.5.0.post1
    out["pillow-simd"] = None if not simd else out["Pillow draft + Pillow bicubic (previous path)"]
    return out


# --- 2. decode stage --------------------------------------------------------------------------------
def bare_loop(docs) -> float:
    start = time.perf_counter()
    for doc in docs:
        _decode_document(doc)
    return len(docs) / (time.perf_counter() - start)


def _decode_document(doc) -> None:
    for seg in doc.media:
        if isinstance(seg, ImageRef):
            decode_item("image", doc.media_bytes[seg.member], (seg.height, seg.width, seg.orientation))
        elif isinstance(seg, GenImageRef):
            decode_item("gen", doc.media_bytes[seg.member], (seg.size, seg.orientation))
        else:
            decode_item("audio", doc.media_bytes[seg.member], (seg.frames, CONFIG.audio))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _spin(n: int = 3_000_000) -> float:
    start, total = time.perf_counter(), 0
    for i in range(n):
        total += i * i
    return time.perf_counter() - start


def _bare_process(conn) -> None:
    """Loop of one 'bare x 2' process: keep the group it is sent, time bare_loop on request (or run
    the pure-compute loop of ``machine_ceiling``)."""
    torch.set_num_threads(1)
    group = None
    while (message := conn.recv()) is not None:
        if message == "run":
            start = time.time()
            bare_loop(group)
            conn.send((start, time.time()))
        elif isinstance(message, tuple) and message[0] == "spin":
            conn.send(_spin(message[1]))
        else:
            group = message
            bare_loop(group)  # warm, as the bare arm is
            conn.send("ok")


class BarePair:
    """Two plain processes each running the bare loop over the whole group at once: what two cores
    give for these operations with no pool at all (the scaling the pool can hope for)."""

    def __init__(self):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_bare_process, args=(child,), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def load(self, group) -> None:
        for conn in self.conns:
            conn.send(group)
        for conn in self.conns:
            conn.recv()

    def rate(self, docs: int) -> float:
        for conn in self.conns:
            conn.send("run")
        spans = [conn.recv() for conn in self.conns]
        return 2 * docs / (max(end for _, end in spans) - min(start for start, _ in spans))

    def spin(self, n: int) -> float:
        """Seconds for both processes to run the pure-compute loop ``_spin(n)`` at once."""
        start = time.perf_counter()
        for conn in self.conns:
            conn.send(("spin", n))
        for conn in self.conns:
            conn.recv()
        return time.perf_counter() - start

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)


def machine_ceiling(pair: BarePair, rounds: int, n: int = 3_000_000) -> float:
    """Two processes of pure compute (the bare pair's) vs one, best of ``rounds``: how far 2 workers
    can scale here."""
    pair.spin(10)
    best = 0.0
    for _ in range(rounds):
        one = _spin(n)
        best = max(best, 2 * one / pair.spin(n))
    return best


def pool_stage(pool: DecodePool, docs) -> float:
    """Documents per second through layout -> pool -> arrays, two microbatches in flight."""
    batches = [docs[i:i + DOCS_PER_MICROBATCH] for i in range(0, len(docs), DOCS_PER_MICROBATCH)]
    in_flight: deque = deque()
    start = time.perf_counter()
    for batch in batches:
        layout = layout_microbatch([PackedSequence(seq_len=1 << 20, documents=batch)], seq_len=1 << 20,
                                   tokenizer=TOKENIZER, audio_config=CONFIG.audio)
        in_flight.append((layout, pool.submit(layout)))
        if len(in_flight) == 2:
            _finish(*in_flight.popleft())
    while in_flight:
        _finish(*in_flight.popleft())
    return len(docs) / (time.perf_counter() - start)


def _finish(layout, future) -> None:
    decoded = future.result()
    if decoded.errors:
        raise RuntimeError(f"decode errors in the benchmark set: {decoded.errors}")
    layout.media_arrays(decoded.buffer)
    decoded.release()


# --- 3. end to end ----------------------------------------------------------------------------------
def _dataloader_sample(sample):
    """What a DataLoader user would write: parse, decode every member, return tensors."""
    try:
        doc = parse_document(sample, image_config=CONFIG.image, tokenizer=TOKENIZER, seq_len=CONFIG.seq_len,
                             audio_config=CONFIG.audio, generation=CONFIG.generation)
    except SampleError:
        return {"__key__": sample["__key__"], "skipped": True}
    out = {"__key__": doc.key, "tokens": [torch.from_numpy(s.ids) for s in doc.segments if hasattr(s, "ids")]}
    media = []
    for seg in doc.media:
        kind = "image" if isinstance(seg, ImageRef) else "gen" if isinstance(seg, GenImageRef) else "audio"
        params = ((seg.height, seg.width, seg.orientation) if kind == "image" else
                  (seg.size, seg.orientation) if kind == "gen" else (seg.frames, CONFIG.audio))
        try:
            media.append(torch.from_numpy(decode_item(kind, doc.media_bytes[seg.member], params)))
        except Exception:
            return {"__key__": doc.key, "skipped": True}
    out["media"] = media
    return out


def _worker_init(_):
    torch.set_num_threads(1)


def dataloader_epoch(urls: list[str]) -> tuple[int, float]:
    import webdataset as wds

    dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False).map(_dataloader_sample)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, worker_init_fn=_worker_init,
                                         prefetch_factor=4, persistent_workers=False)
    count, start = 0, None
    for item in loader:
        if start is None:
            start = time.perf_counter()  # from the first sample: worker start-up left out, as for the service
        count += 0 if item.get("skipped") else 1
    return count, time.perf_counter() - start


def service_epoch(urls: list[str]) -> tuple[int, float]:
    from disttrain_tools.runner import run_job

    config = JobConfig(shards=tuple(urls), dp_size=1, num_microbatches=4, seqs_per_microbatch=2)
    result = run_job(config, progress=False)
    if not result.exactly_once()["ok"]:
        raise RuntimeError(f"service run failed its exactly-once check: {result.exactly_once()}")
    rank = result.ranks[0]
    return len(rank.keys), rank.seconds


CONFIG = JobConfig(shards=("unused",))


def bench_tokenizers(specs: list[str], workdir: Path, num_captions: int = 20000) -> dict:
    """Captions per CPU-second of every tokenizer, per text and in batches of 1,024."""
    os.environ["RAYON_NUM_THREADS"] = "1"  # before the Rust tokenizer's thread pool starts
    from disttrain_tools import synth
    from preprocess_service.adapters.media.tokenizers import load_tokenizer, train_bpe, train_sentencepiece

    rng = np.random.default_rng(0)
    captions = [synth._draw_caption(rng) for _ in range(num_captions)]
    training = captions[: num_captions // 2]
    tokenizers = {"byte": load_tokenizer("byte"),
                  "BPE tokenizer.json (8k)": load_tokenizer(f"hf:{train_bpe(training, workdir / 'bpe.json')}"),
                  "sentencepiece unigram (8k)": load_tokenizer(
                      f"sentencepiece:{train_sentencepiece(training, workdir / 'sp.model')}")}
    tokenizers.update({spec: load_tokenizer(spec) for spec in specs})
    rows = {}
    for name, tok in tokenizers.items():
        start = time.process_time()
        tokens = sum(len(tok.encode(text)) for text in captions)
        single = len(captions) / (time.process_time() - start)
        batch_fn = getattr(tok, "encode_batch", None)
        start = time.process_time()
        if batch_fn is not None:
            for i in range(0, len(captions), 1024):
                batch_fn(captions[i:i + 1024])
        batched = len(captions) / (time.process_time() - start) if batch_fn is not None else float("nan")
        rows[name] = {"per_text": single, "batched": batched, "tokens_per_caption": tokens / len(captions),
                      "vocab_size": tok.vocab_size}
        print(f"   {name:32s} {single:10.0f} {batched:10.0f} {tokens / len(captions):8.1f} {tok.vocab_size:7d}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", nargs="+", help="shard specs (default: the synthetic demo set)")
    parser.add_argument("--max-docs", type=int, default=240,
                        help="documents per modality in part 2 (a group is cycled up to this)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per group in part 2")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--only", choices=("tokenizers", "trim"), help="run only this part (trim: the decode "
                        "workers' heap trimming on camera photos, bench/peers_corpus.py's unless --shards)")
    parser.add_argument("--tokenizer", action="append", default=[],
                        help="also measure this tokenizer (hf:PATH, sentencepiece:PATH)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: one shard of 40 synthetic samples, 16 documents per modality, one round, "
                             "500 captions")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_docs, args.rounds = min(args.max_docs, DOCS_PER_MICROBATCH), 1
    torch.set_num_threads(1)
    if args.only == "tokenizers":
        return _tokenizer_part(args, {})
    if args.only == "trim":
        return _trim_part(args)
    specs = args.shards or (benchjson.quick_shards() if args.quick else
                            [str(p) for p in ensure_demo_dataset(REPO / "data" / "laion-demo")])
    urls = shards.expand_shards(specs)
    docs = load_documents(urls, CONFIG)
    figures: dict = {"cores": len(os.sched_getaffinity(0))}

    paths = bench_image_paths(docs, repeats=1, max_images=20) if args.quick else bench_image_paths(docs)
    figures["image_paths"] = paths
    print(f"1. image paths, one core, JPEGs to their planned size ({figures['cores']} cores on this machine)")
    for name, rate in paths.items():
        print(f"   {name:48s} " + (f"{rate:7.1f} images/s" if rate else "not installed: it replaces Pillow and "
                                   "needs a compiler build from source (pip install pillow-simd)"))

    groups = {
        "image": [d for d in docs if d.images and not d.audio and not d.generated],
        "audio": [d for d in docs if d.audio and not d.images and not d.generated],
        "generation": [d for d in docs if d.generated],
        "mixed": docs,
    }
    groups = {name: (group * (args.max_docs // len(group) + 1))[:args.max_docs]
              for name, group in groups.items() if group}
    print("\n2. decode stage, samples/s (bare: same operations in a plain loop, one process); "
          f"best of {args.rounds} interleaved rounds")
    print(f"   {'modality':11s} {'docs':>5s} {'bare':>8s} {'1 worker':>9s} {'2 workers':>10s} "
          f"{'1w/bare':>8s} {'2w/1w':>6s} {'bare x2':>8s} {'x2/bare':>8s} {'2w/x2':>6s} {'parent':>7s}")
    stage = {}
    pools = {n: DecodePool(n) for n in (1, 2)}
    pair = BarePair()
    try:
        for name, group in groups.items():
            # A first pass per pool warms every process's caches (resampler kernels per sample
            # rate, mel filterbank), which the bare process already has.
            for pool in pools.values():
                pool_stage(pool, group)
            pair.load(group)
            row = {"docs": len(group), "bare": 0.0, "bare2": 0.0, "w1": 0.0, "w2": 0.0,
                   "parent_ms_per_doc": float("inf")}
            for _ in range(args.rounds):
                row["bare"] = max(row["bare"], bare_loop(group))
                row["bare2"] = max(row["bare2"], pair.rate(len(group)))
                row["w1"] = max(row["w1"], pool_stage(pools[1], group))
                cpu = cpu_seconds()
                row["w2"] = max(row["w2"], pool_stage(pools[2], group))
                row["parent_ms_per_doc"] = min(row["parent_ms_per_doc"], 1000 * (cpu_seconds() - cpu) / len(group))
            row["w1_over_bare"], row["w2_over_w1"] = row["w1"] / row["bare"], row["w2"] / row["w1"]
            row["bare2_over_bare"], row["w2_over_bare2"] = row["bare2"] / row["bare"], row["w2"] / row["bare2"]
            stage[name] = row
            print(f"   {name:11s} {row['docs']:5d} {row['bare']:8.1f} {row['w1']:9.1f} {row['w2']:10.1f} "
                  f"{row['w1_over_bare']:8.2f} {row['w2_over_w1']:6.2f} {row['bare2']:8.1f} "
                  f"{row['bare2_over_bare']:8.2f} {row['w2_over_bare2']:6.2f} {row['parent_ms_per_doc']:7.2f}")
        for pool in pools.values():
            pool.close()
        figures["machine_ceiling_2p_over_1p"] = machine_ceiling(pair, args.rounds,
                                                                300_000 if args.quick else 3_000_000)
    finally:
        pair.close()
        for pool in pools.values():
            pool.close()
    print("   bare x2: two plain processes running the bare loop at once, no pool (what two cores give these\n"
          "   operations here); 2w/x2: the pool against that; parent: the pool's CPU in the parent, ms/document")
    print(f"   this machine's own ceiling in this run: pure-Python loop, 2 processes / 1 = "
          f"{figures['machine_ceiling_2p_over_1p']:.2f}")
    figures["stage"] = stage

    print("\n3. end to end over the whole data set, samples/s")
    dl_count, dl_seconds = dataloader_epoch(urls)
    sv_count, sv_seconds = service_epoch(urls)
    figures["end_to_end"] = {"dataloader_samples": dl_count, "dataloader_s": dl_seconds,
                             "service_samples": sv_count, "service_s": sv_seconds,
                             "ratio": (sv_count / sv_seconds) / (dl_count / dl_seconds)}
    print(f"   DataLoader(num_workers=2) over webdataset  {dl_count:5d} samples in {dl_seconds:6.2f} s = "
          f"{dl_count / dl_seconds:7.1f} samples/s")
    print(f"   service (packed, planned, gRPC, 1 client)  {sv_count:5d} samples in {sv_seconds:6.2f} s = "
          f"{sv_count / sv_seconds:7.1f} samples/s")
    print(f"   ratio service / DataLoader: {figures['end_to_end']['ratio']:.2f}")
    return _tokenizer_part(args, figures)


TRIM_POLICIES = {"keep (never trim)": None, "trim above 16 MiB free (before)": 16 << 20,
                 "trim above TRIM_ABOVE_BYTES (now)": "now", "trim after every photo": 0}


def bench_trim(photos: list[bytes], rounds: int) -> dict[str, dict]:
    """A decode worker's loop over camera photos (decode, EXIF orientation, resize to the planned
    size into one reused buffer) under each heap-trimming policy: CPU, system CPU and minor page
    faults per photo (best round), and the heap malloc holds free after a photo."""
    from disttrain_api.heap import free_heap_bytes, trim_malloc
    from preprocess_service.adapters.decode.worker import TRIM_ABOVE_BYTES
    from preprocess_service.adapters.media import imaging

    sizes = []
    for data in photos:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if image.getexif().get(0x0112, 1) in (5, 6, 7, 8):
                width, height = height, width
        sizes.append(imaging.target_size(width, height, CONFIG.image))
    out = np.empty(max(h * w * 3 for h, w in sizes), np.uint8)
    results: dict[str, dict] = {}
    for _ in range(rounds):
        for name, above in TRIM_POLICIES.items():
            above = TRIM_ABOVE_BYTES if above == "now" else above
            trim_malloc()
            free_after = []
            before, cpu = resource.getrusage(resource.RUSAGE_SELF), cpu_seconds()
            for data, (h, w) in zip(photos, sizes):
                imaging.decode_image(data, (h, w), out=out[:h * w * 3].reshape(h, w, 3))
                free = free_heap_bytes() or 0
                free_after.append(free)
                if above is not None and free > above:
                    trim_malloc()
            after, cpu = resource.getrusage(resource.RUSAGE_SELF), cpu_seconds() - cpu
            row = {"cpu_ms": 1000 * cpu / len(photos),
                   "system_ms": 1000 * (after.ru_stime - before.ru_stime) / len(photos),
                   "minor_faults": (after.ru_minflt - before.ru_minflt) / len(photos),
                   "free_mib_median": float(np.median(free_after)) / 2**20, "free_mib_max": max(free_after) / 2**20}
            if name not in results or row["cpu_ms"] < results[name]["cpu_ms"]:
                results[name] = row
    return results


def _trim_part(args) -> int:
    import tarfile

    import peers_corpus

    quick_corpus = peers_corpus.CameraCorpus(shards=1, per_shard=12, megapixels=(1.0, 4.0))
    urls = args.shards or (peers_corpus.ensure(REPO / "data" / "peers-camera-quick", quick_corpus) if args.quick
                           else peers_corpus.ensure())
    count = 12 if args.quick else 160
    photos: list[bytes] = []
    for url in urls:
        with tarfile.open(url) as tar:
            photos += [tar.extractfile(m).read() for m in tar if m.name.endswith((".jpg", ".jpeg"))]
        if len(photos) >= count:
            break
    photos = photos[:count]
    rounds = 1 if args.quick else args.rounds
    print(f"heap trimming in a decode worker's loop: {len(photos)} camera photos, best of {rounds} rounds")
    rows = bench_trim(photos, rounds)
    columns = ["policy", "CPU ms/photo", "system ms/photo", "minor faults/photo", "free heap MiB after a photo "
               "(median)", "(max)"]
    table = [[name, round(r["cpu_ms"], 2), round(r["system_ms"], 2), round(r["minor_faults"]),
              round(r["free_mib_median"], 1), round(r["free_mib_max"], 1)] for name, r in rows.items()]
    for row in table:
        print("   " + " | ".join(str(c) for c in row))
    doc = benchjson.document("decode", quick=args.quick) | {"trim": rows, "title": "decode: heap trimming"}
    doc["tables"].append(benchjson.table("heap trimming in a decode worker's loop (camera photos)", columns, table,
                                         notes=["one process; each photo decoded, oriented and resized to its "
                                                "planned size into one reused buffer"]))
    benchjson.write(args.json, doc)
    return 0


def _tokenizer_part(args, figures: dict) -> int:
    import tempfile

    print("\n4. tokenizers, captions per CPU-second (one thread)")
    print(f"   {'tokenizer':32s} {'per text':>10s} {'batched':>10s} {'tokens':>8s} {'vocab':>7s}")
    with tempfile.TemporaryDirectory(prefix="disttrain-tok-") as workdir:
        figures["tokenizers"] = bench_tokenizers(args.tokenizer, Path(workdir), 500 if args.quick else 20000)
    benchjson.write(args.json, document(figures, args.quick))
    return 0


def document(figures: dict, quick: bool) -> dict:
    """The --json document: the printed tables, and the raw figures as extra keys."""
    doc = benchjson.document("decode", quick=quick) | figures
    tables = doc["tables"]
    if "image_paths" in figures:
        tables.append(benchjson.table(
            "image paths, one core, JPEGs to their planned size", ["path", "images/s"],
            [[name, None if rate is None else round(rate, 1)] for name, rate in figures["image_paths"].items()],
            notes=["pillow-simd: null when not installed (it replaces Pillow and needs a build from source)"]))
    if "stage" in figures:
        tables.append(benchjson.table(
            "decode stage, samples/s (best of the interleaved rounds)",
            ["modality", "docs", "bare", "1 worker", "2 workers", "1w/bare", "2w/1w", "bare x2", "x2/bare", "2w/x2",
             "parent ms/doc"],
            [[name, row["docs"], round(row["bare"], 1), round(row["w1"], 1), round(row["w2"], 1),
              round(row["w1_over_bare"], 2), round(row["w2_over_w1"], 2), round(row["bare2"], 1),
              round(row["bare2_over_bare"], 2), round(row["w2_over_bare2"], 2), round(row["parent_ms_per_doc"], 2)]
             for name, row in figures["stage"].items()],
            notes=["bare: the same decode operations in a plain loop, one process; bare x2: two such processes at "
                   "once, no pool; parent: the pool's CPU in the parent process",
                   "targets: 1 worker >= 0.9 x bare, 2 workers >= 1.8 x 1 worker",
                   f"this machine's ceiling in this run, pure-Python loop, 2 processes / 1: "
                   f"{figures['machine_ceiling_2p_over_1p']:.2f}"]))
    if "end_to_end" in figures:
        e2e = figures["end_to_end"]
        tables.append(benchjson.table(
            "end to end over the whole data set", ["system", "samples", "seconds", "samples/s"],
            [["DataLoader(num_workers=2) over webdataset", e2e["dataloader_samples"], round(e2e["dataloader_s"], 2),
              round(e2e["dataloader_samples"] / e2e["dataloader_s"], 1)],
             ["service (packed, planned, gRPC, 1 client)", e2e["service_samples"], round(e2e["service_s"], 2),
              round(e2e["service_samples"] / e2e["service_s"], 1)]],
            notes=[f"ratio service / DataLoader: {e2e['ratio']:.2f} (target >= 1.0)"]))
    if "tokenizers" in figures:
        tables.append(benchjson.table(
            "tokenizers, captions per CPU-second (one thread)",
            ["tokenizer", "per text", "batched", "tokens/caption", "vocab"],
            [[name, round(row["per_text"]), None if row["batched"] != row["batched"] else round(row["batched"]),
              round(row["tokens_per_caption"], 1), row["vocab_size"]] for name, row in figures["tokenizers"].items()],
            notes=["batched: encode_batch of 1,024 captions per call (the service's path); null without one"]))
    return doc


if __name__ == "__main__":
    sys.exit(main())
