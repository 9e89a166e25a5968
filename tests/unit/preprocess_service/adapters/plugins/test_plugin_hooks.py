"""Operator plugins in a job: installed as packages with entry points, named by the job, run in
worker processes; filters and rewrites are planned from, media hooks change the decoded pixels,
and a hook that raises, hangs, leaks or breaks the rules fails its own sample only."""

import collections
import textwrap
from pathlib import Path

import numpy as np
import pytest

from disttrain_api.config import JobConfig, PluginConfig
from disttrain_api.errors import ConfigError
from helpers import check_resumes, install_plugins, shard_keys, write_tiny_shards
from preprocess_service.adapters.decode import DecodePool, InlineDecoder
from preprocess_service.adapters.io.shards import ShardReader
from preprocess_service.adapters.plugins.hooks import HookLimits
from preprocess_service.core.planner import Documents, EpochPlanner
from preprocess_service.service.job import Job

SOURCE = textwrap.dedent('''
    import time

    from disttrain_api.plugins import Plugin, Skip

    HELD = []

    class Caption(Plugin):
        """Rewrites the caption: the key, a number drawn from ctx.rng, and the epoch."""
        def __init__(self, params):
            super().__init__(params)
            if not isinstance(params.get("prefix", ""), str):
                raise ValueError("prefix must be a string")
            self.prefix = params.get("prefix", "")
        def sample(self, members, ctx):
            text = f"{self.prefix}{ctx.key} {int(ctx.rng.integers(10**6))} e{ctx.epoch}"
            return {**members, "txt": text.encode()}

    class DropOdd(Plugin):
        def sample(self, members, ctx):
            if int(ctx.key) % 2:
                raise Skip(f"odd key {ctx.key}")

    class Faulty(Plugin):
        """Raises on keys ending in 3, hangs on 5, leaks 300 MB on 7."""
        def sample(self, members, ctx):
            last = ctx.key[-1]
            if last == "3":
                raise RuntimeError("boom")
            if last == "5":
                while True:
                    time.sleep(0.01)
            if last == "7":
                HELD.append(bytearray(300 << 20))
            return None

    class SwapMedia(Plugin):
        def sample(self, members, ctx):
            return {**members, "jpg": members["jpg"][:-1]}

    class Invert(Plugin):
        def media(self, kind, array, ctx):
            array[...] = 255 - array

    class Jitter(Plugin):
        def media(self, kind, array, ctx):
            return np.clip(array.astype(np.int16) + ctx.rng.integers(-3, 4, array.shape), 0, 255).astype(array.dtype)

    class MediaHog(Plugin):
        """Allocates 16 MiB at a time (every page written) up to 768 MiB, noting each in params["log"]."""
        def media(self, kind, array, ctx):
            held = []
            for chunk in range(48):
                held.append(np.ones(2 << 20))
                with open(self.params["log"], "a") as log:
                    log.write(f"{chunk + 1} ")

    class Burn(Plugin):
        """Takes at least params["sample_ms"] of CPU on each sample and params["media_ms"] on each item."""
        def _burn(self, ms):  # this thread's CPU: InlineDecoder runs a task's hooks on several threads at once
            until = time.thread_time() + ms / 1e3
            while time.thread_time() < until:
                pass
        def sample(self, members, ctx):
            self._burn(self.params["sample_ms"])
        def media(self, kind, array, ctx):
            self._burn(self.params["media_ms"])

    class Digest(Plugin):
        """Writes the sha256 of every member it sees into "digest.json"."""
        def sample(self, members, ctx):
            import hashlib
            import json
            seen = {k: hashlib.sha256(v).hexdigest() for k, v in sorted(members.items())}
            return {**members, "digest.json": json.dumps(seen).encode()}

    class MediaFaulty(Plugin):
        """Raises on keys ending in 1, hangs on 2, returns a wrong shape on 6."""
        def media(self, kind, array, ctx):
            last = ctx.key[-1]
            if last == "1":
                raise ValueError("bad pixels")
            if last == "2":
                while True:
                    time.sleep(0.01)
            if last == "6":
                return array[:1]
''').replace("import time\n", "import time\n\nimport numpy as np\n", 1)

ENTRY_POINTS = {"caption": "Caption", "drop_odd": "DropOdd", "faulty": "Faulty", "swap_media": "SwapMedia",
                "invert": "Invert", "jitter": "Jitter", "media_faulty": "MediaFaulty", "media_hog": "MediaHog",
                "burn": "Burn", "digest": "Digest"}
FAST = HookLimits(time_s=1.0, memory_bytes=200 << 20)


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(install_plugins(tmp_path / "site", "test_plugins_pkg", SOURCE, ENTRY_POINTS)))


def _config(folder, *names, seed=0, **params):
    return JobConfig(shards=(str(folder),), seq_len=1024, dp_size=1, num_microbatches=2, shuffle_buffer=16,
                     seed=seed, plugins=tuple(PluginConfig(name=n, params=params.get(n, {})) for n in names))


def _delivered(job, decoder):
    """Every microbatch of the epoch: (step, index) -> arrays; and the keys delivered."""
    out, keys = {}, []
    for step in range(job.plan_all()):
        for index in range(job.step_plan(step).num_microbatches):
            result = job.microbatch(job.step_plan(step), 0, index, decoder)
            out[step, index] = result.arrays
            keys += result.sample_keys
    return out, keys


def _text(arrays) -> bytes:
    ids, modality = arrays["tokens"], arrays["modality"]
    return bytes(ids[(modality == 1) & (ids < 256)].astype(np.uint8))


def _skipped(job):
    return {s.key: {"kind": s.kind, "reason": s.reason} for s in job.report()["skipped"]}


def test_a_job_naming_a_plugin_not_installed_or_with_bad_params_is_refused(tmp_path, plugins):
    write_tiny_shards(tmp_path / "d", num_shards=1, samples_per_shard=4)
    with pytest.raises(ConfigError, match=r"'nope' is not installed.*'caption'"):
        Job(_config(tmp_path / "d", "nope"))
    with pytest.raises(ConfigError, match="caption.*prefix must be a string"):
        Job(_config(tmp_path / "d", "caption", caption={"prefix": 3}))
    with pytest.raises(ConfigError, match="distinct"):
        _config(tmp_path / "d", "caption", "caption")


def test_sample_hooks_filter_and_rewrite_deterministically_by_seed_key_and_epoch(tmp_path, plugins):
    paths = write_tiny_shards(tmp_path / "d", num_shards=2, samples_per_shard=10)
    keys = shard_keys(paths)
    job = Job(_config(tmp_path / "d", "drop_odd", "caption", caption={"prefix": "NEW "}))
    arrays, delivered = _delivered(job, InlineDecoder())
    odd = {k for k in keys if int(k) % 2}
    skipped = _skipped(job)
    assert set(skipped) == odd and {s["kind"] for s in skipped.values()} == {"filtered"}
    assert "odd key" in next(iter(skipped.values()))["reason"]
    assert sorted(delivered) == sorted(keys - odd)  # each other key once
    texts = b"".join(_text(a) for a in arrays.values())
    assert all(f"NEW {k} ".encode() in texts for k in keys - odd) and b"caption of sample" not in texts

    again, _ = _delivered(Job(_config(tmp_path / "d", "drop_odd", "caption", caption={"prefix": "NEW "})),
                          InlineDecoder())
    for where, got in again.items():  # a job opened again (a resumed one replans) sees the same
        np.testing.assert_array_equal(got["tokens"], arrays[where]["tokens"])
    other, _ = _delivered(Job(_config(tmp_path / "d", "drop_odd", "caption", seed=1, caption={"prefix": "NEW "})),
                          InlineDecoder())
    reader = ShardReader()

    def make():  # a planner restored from any step's state plans what the original planned from there
        return EpochPlanner(job.config, reader.expand(job.config.shards), Documents(reader, job.documents.parse_only))

    def advance(planner):
        plan = planner.next_plan()
        return None if plan is None or plan.epoch else [(d.key, d.num_tokens) for d in plan.documents()]

    check_resumes(make, advance, at=lambda n: range(1, n))
    other_texts = b"".join(_text(a) for a in other.values())
    assert other_texts != texts and all(f"NEW {k} ".encode() in other_texts for k in keys - odd)


def test_a_sample_hook_that_raises_hangs_or_leaks_fails_only_its_sample(tmp_path, plugins):
    paths = write_tiny_shards(tmp_path / "d", num_shards=1, samples_per_shard=10)
    keys = shard_keys(paths)
    job = Job(_config(tmp_path / "d", "faulty"), plugin_limits=FAST)
    _, delivered = _delivered(job, InlineDecoder())
    skipped = _skipped(job)
    reasons = {key[-1]: skipped[key]["reason"] for key in skipped}
    assert set(reasons) == {"3", "5", "7"} and {s["kind"] for s in skipped.values()} == {"plugin_failed"}
    assert "'faulty' sample hook failed: RuntimeError: boom" in reasons["3"]
    assert "1 s limit" in reasons["5"] or "did not finish" in reasons["5"]
    assert "budget" in reasons["7"]
    assert sorted(delivered) == sorted(keys - set(skipped))
    assert job.documents.hooks.starts >= 2  # the leaking worker was replaced
    job.close()


def test_a_sample_hook_may_not_change_media(tmp_path, plugins):
    paths = write_tiny_shards(tmp_path / "d", num_shards=1, samples_per_shard=4)
    job = Job(_config(tmp_path / "d", "swap_media"))
    assert job.plan_all() == 0
    skipped = _skipped(job)
    assert set(skipped) == shard_keys(paths)
    assert all("changed or added media member 'jpg'" in s["reason"] for s in skipped.values())


def test_media_hooks_run_in_the_decode_workers_deterministically_and_fail_only_their_sample(tmp_path, plugins):
    paths = write_tiny_shards(tmp_path / "d", num_shards=1, samples_per_shard=10)
    keys = shard_keys(paths)
    pool = DecodePool(2)
    try:
        plain, plain_keys = _delivered(Job(_config(tmp_path / "d")), pool)
        inverted, _ = _delivered(Job(_config(tmp_path / "d", "invert")), pool)
        for where, arrays in plain.items():  # one plan: media hooks do not change what is planned
            np.testing.assert_array_equal(inverted[where]["pixels"], 255 - arrays["pixels"])
        jittered = [_delivered(Job(_config(tmp_path / "d", "jitter")), decoder)[0]
                    for decoder in (pool, InlineDecoder())]
        for where, arrays in jittered[0].items():  # same seed, key, epoch: same pixels in any worker
            np.testing.assert_array_equal(arrays["pixels"], jittered[1][where]["pixels"])
            assert not np.array_equal(arrays["pixels"], plain[where]["pixels"])

        job = Job(_config(tmp_path / "d", "media_faulty"), plugin_limits=FAST)
        faulty, delivered = _delivered(job, pool)
        skipped = _skipped(job)
        reasons = {key[-1]: skipped[key]["reason"] for key in skipped}
        assert set(reasons) == {"1", "2", "6"}, reasons
        assert "'media_faulty' media hook on 'jpg' failed: ValueError: bad pixels" in reasons["1"]
        assert "1 s limit" in reasons["2"]
        assert "returned (1," in reasons["6"]
        assert {s["kind"] for s in skipped.values()} == {"plugin_failed"}
        assert collections.Counter(delivered) == collections.Counter(keys - set(skipped))
        assert sorted(plain_keys) == sorted(keys)
    finally:
        pool.close()


def test_a_media_hook_is_held_to_its_memory_budget_while_it_runs(tmp_path, plugins):
    paths = write_tiny_shards(tmp_path / "d", num_shards=1, samples_per_shard=2)
    log = tmp_path / "hog.log"
    pool = DecodePool(1)
    try:
        job = Job(_config(tmp_path / "d", "media_hog", media_hog={"log": str(log)}),
                  plugin_limits=HookLimits(time_s=30.0, memory_bytes=200 << 20))
        _, delivered = _delivered(job, pool)
    finally:
        pool.close()
    skipped = _skipped(job)
    assert set(skipped) == shard_keys(paths) and not delivered
    assert {s["kind"] for s in skipped.values()} == {"plugin_failed"}
    assert all("past its memory budget of 200 MiB; stopped" in s["reason"] for s in skipped.values()), skipped
    # each call stopped within a chunk of the budget (it would have written 48 lines: 768 MiB)
    chunks = [int(line) for line in log.read_text().split()]
    assert chunks and max(chunks) * 16 <= 200, max(chunks)


@pytest.mark.parametrize("workers", [2, 0], ids=["pool", "inline"])
def test_each_hook_reports_its_cpu_per_sample_in_the_report_and_the_metrics(tmp_path, plugins, workers):
    """A hook that takes a known CPU time is shown with at least that much per call, and with one
    call per planned sample (sample hook) or decoded item (media hook), in the job's report (what
    ``status`` prints) and the disttrain_plugin_* counters."""
    from preprocess_service.adapters.infra import metrics

    paths = write_tiny_shards(tmp_path / "d", num_shards=1, samples_per_shard=10)
    keys = shard_keys(paths)
    decoder = DecodePool(workers) if workers else InlineDecoder()
    try:
        job = Job(_config(tmp_path / "d", "burn", "caption", burn={"sample_ms": 4, "media_ms": 3}))
        arrays, delivered = _delivered(job, decoder)
    finally:
        decoder.close()
    assert sorted(delivered) == sorted(keys)
    items = sum(len(a["image_spans"]) for a in arrays.values())
    assert items > 0
    rows = {(r["plugin"], r["hook"]): r for r in job.report()["plugins"]}
    assert set(rows) == {("burn", "sample"), ("burn", "media"), ("caption", "sample")}
    assert rows["burn", "sample"]["calls"] == rows["caption", "sample"]["calls"] == len(keys)
    assert rows["burn", "media"]["calls"] == items
    assert rows["burn", "sample"]["cpu_s"] >= 0.004 * len(keys)
    assert rows["burn", "media"]["cpu_s"] >= 0.003 * items
    assert 0 < rows["caption", "sample"]["cpu_s"] < rows["burn", "sample"]["cpu_s"]
    for (plugin, hook), row in rows.items():
        assert metrics.PLUGIN_CALLS.labels(job.job_id, plugin, hook)._value.get() == row["calls"]
        assert metrics.PLUGIN_CPU.labels(job.job_id, plugin, hook)._value.get() == pytest.approx(row["cpu_s"])


@pytest.mark.parametrize("via", ["shared memory", "pipe", "full /dev/shm"])
def test_a_sample_hook_sees_every_member_byte_for_byte_whichever_way_it_crossed(plugins, monkeypatch, via):
    """Large members cross to the hook worker through shared memory (one copy each way), or through
    the pipe past SHARED_MAX_BYTES or when /dev/shm has no room; either way the hook sees the same
    bytes, a sample that outgrows the shared object gets a bigger one, and one whose name was
    removed from /dev/shm a new one."""
    import hashlib
    import json

    from disttrain_api.config import PluginConfig
    from preprocess_service.adapters.plugins import host
    from preprocess_service.adapters.plugins.hooks import HookSpec

    if via == "pipe":
        monkeypatch.setattr(host, "SHARED_MAX_BYTES", 1000)
    if via == "full /dev/shm":  # no room for the object's pages: the pipe, never a SIGBUS later
        def no_room(fd, offset, length):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(host.os, "posix_fallocate", no_room)
    rng = np.random.default_rng(0)
    hooks = host.SampleHooks(HookSpec((PluginConfig(name="digest"),), 0, 0))
    try:
        for size in (5000, 3 << 20, 100_000, 200_000):  # the second outgrows the first object
            if size == 200_000:  # someone cleaned /dev/shm, and the worker was replaced: a new object
                if hooks._shared is not None:
                    (Path("/dev/shm") / hooks._shared.name).unlink()
                hooks._stop(kill=True)
            sample = {"__key__": f"k{size}", "__url__": "u.tar", "txt": b"a caption",
                      "jpg": rng.integers(0, 256, size, np.uint8).tobytes(),
                      "png": rng.integers(0, 256, size // 2 + 1, np.uint8).tobytes()}
            out = hooks.apply(sample, epoch=0)
            seen = json.loads(out["digest.json"])
            assert seen == {k: hashlib.sha256(v).hexdigest() for k, v in sample.items() if not k.startswith("__")}
            assert out["jpg"] is sample["jpg"]  # unchanged members are the parent's own
        assert (hooks._shared is not None) == (via == "shared memory")
        assert hooks.starts == 2
    finally:
        hooks.close()
    assert hooks._shared is None


def test_what_the_hook_worker_says_it_spent_is_kept_only_where_it_is_a_plausible_cost(plugins):
    """The sample-hook worker runs plugin code: a reply's costs that name another plugin or hook,
    or carry a negative, infinite or non-number figure, are dropped, never counted or exported."""
    from disttrain_api.config import PluginConfig
    from preprocess_service.adapters.plugins import host
    from preprocess_service.adapters.plugins.hooks import HookCost, HookSpec

    hooks = host.SampleHooks(HookSpec((PluginConfig(name="caption"), PluginConfig(name="digest")), 0, 0))
    good = HookCost(0.002, 1)
    assert hooks._checked_costs({("caption", "sample"): good}) == {("caption", "sample"): good}
    for bad in ({("other", "sample"): good}, {("caption", "media"): good}, {("caption", "sample"): HookCost(-1.0, 1)},
                {("caption", "sample"): HookCost(float("inf"), 1)}, {("caption", "sample"): HookCost(0.1, 10**9)},
                {("caption", "sample"): (0.1, 1)}, {"caption": good}, [good], None):
        assert hooks._checked_costs(bad) == {}, bad
