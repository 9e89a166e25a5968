"""Weighted dataset mixtures: the blend follows the weights, is deterministic from the seed, ends an
epoch by the job's rule, resumes mid-mixture to the same sequence, and reads mixture files."""

import json

import numpy as np
import pytest

from disttrain_api.config import DatasetConfig, ImageConfig, JobConfig
from disttrain_api.errors import ConfigError
from disttrain_api.mixture import load_mixture, parse_mixture
from helpers import check_resumes, write_tiny_shards
from preprocess_service.core.mixture import Blend
from preprocess_service.core.planner import Documents, EpochPlanner
from preprocess_service.service.job import Job

pytestmark = pytest.mark.unit


def test_the_blend_keeps_every_prefix_within_one_sample_of_the_weights():
    config = JobConfig(datasets=(DatasetConfig(name="a", shards=("x",), weight=5),
                                 DatasetConfig(name="b", shards=("y",), weight=3),
                                 DatasetConfig(name="c", shards=("z",), weight=2)))
    blend = Blend.of(config)
    live = np.ones(3, dtype=bool)
    for n in range(1, 1001):
        blend.record(blend.choose(live), 1)
        assert np.all(np.abs(blend.counts - blend.weights * n) <= 1.0), (n, blend.counts)
    assert blend.counts.tolist() == [500, 300, 200]
    blend = Blend.of(config)
    live[0] = False  # a dataset out of the blend is never chosen; the others keep their ratio
    picks = [blend.choose(live) for _ in range(50) if not blend.record(blend.choose(live), 1)]
    assert 0 not in picks and abs(blend.counts[1] / blend.counts[2] - 1.5) < 0.1


def _mixture(tmp_path, *, sizes=(3, 1), weights=(0.75, 0.25), **extra) -> JobConfig:
    datasets = []
    for i, (num_shards, weight) in enumerate(zip(sizes, weights)):
        folder = tmp_path / f"ds{i}"
        write_tiny_shards(folder, num_shards=num_shards, samples_per_shard=10, seed=i)  # the same keys in each
        datasets.append(DatasetConfig(name=f"ds{i}", shards=(str(folder),), weight=weight))
    fields = dict(datasets=tuple(datasets), seq_len=1024, dp_size=2, num_microbatches=2, shuffle_buffer=5,
                  pack_window=3)
    return JobConfig(**{**fields, **extra})


def _drawn(job: Job) -> list[tuple[int, str]]:
    """(dataset, key) of every planned document, in planning order over the whole job."""
    job.plan_all()
    out = []
    for step in range(job.num_steps()):
        out.extend((doc.dataset, doc.key) for doc in job.step_plan(step).documents())
    return out


def test_first_exhausted_ends_the_epoch_when_the_small_dataset_runs_out(tmp_path):
    config = _mixture(tmp_path, sizes=(3, 1), weights=(0.5, 0.5))
    job = Job(config)
    drawn = _drawn(job)
    per = [sum(1 for d, _ in drawn if d == i) for i in (0, 1)]
    assert per == [10, 10] or per == [11, 10], per  # ds1's 10 samples; ds0 drew as many (+1 drawn before the end)
    assert len(set(drawn)) == len(drawn), "no sample repeats"
    assert {key for d, key in drawn if d == 1} == {f"00000{i:04d}" for i in range(10)}  # ds0 has these keys too
    counts = job.report()["datasets"]
    assert [c["num_samples"] for c in counts] == per and all(c["restarts"] == 0 for c in counts)


def test_all_exhausted_restarts_the_small_dataset_until_the_big_one_is_read_through(tmp_path):
    config = _mixture(tmp_path, sizes=(3, 1), weights=(0.5, 0.5), mix_epoch="all_exhausted")
    drawn = _drawn(Job(config))
    big = [key for d, key in drawn if d == 0]
    small = [key for d, key in drawn if d == 1]
    assert sorted(big) == sorted(set(big)) and len(big) == 30, "every sample of the big dataset, once"
    assert abs(len(small) - len(big)) <= 1 and len(set(small)) == 10, "the small one cycled, same share"


def test_a_fixed_epoch_size_and_token_weights(tmp_path):
    config = _mixture(tmp_path, sizes=(1, 1), weights=(0.9, 0.1), mix_epoch_samples=35, num_epochs=2)
    drawn = _drawn(Job(config))
    assert len(drawn) == 70 and sum(1 for d, _ in drawn[:35] if d == 0) in (31, 32)
    by_tokens = _mixture(tmp_path, sizes=(2, 2), weights=(0.5, 0.5), mix_by="tokens")
    job = Job(by_tokens)
    job.plan_all()
    tokens = [c["num_tokens"] for c in job.report()["datasets"]]
    largest = max(doc.num_tokens for s in range(job.num_steps()) for doc in job.step_plan(s).documents())
    assert abs(tokens[0] - tokens[1]) <= largest, tokens  # within one document's tokens
    samples = [c["num_samples"] for c in job.report()["datasets"]]
    assert samples[0] != samples[1] or tokens[0] != tokens[1], "balanced by tokens, not by count"


@pytest.mark.parametrize("rule", [{"mix_epoch": "all_exhausted"}, {"mix_by": "tokens"}, {"mix_epoch_samples": 23},
                                  {"dead": True}], ids=["all_exhausted", "tokens", "fixed", "dead_dataset"])
def test_the_blend_is_a_function_of_the_seed_and_resumes_mid_mixture(tmp_path, rule):
    rule = dict(rule)
    dead = rule.pop("dead", False)
    config = _mixture(tmp_path, sizes=(2, 1), weights=(0.6, 0.4), num_epochs=2, max_error_fraction=1.0,
                      max_consecutive_errors=1000, **rule)
    if dead:  # a third dataset whose every sample is bad: it leaves the blend, the others go on
        write_tiny_shards(tmp_path / "bad", num_shards=1, samples_per_shard=0,
                          extra={f"bad{i}": {"jpg": b"not a jpeg", "txt": b"x"} for i in range(5)})
        bad = DatasetConfig(name="bad", shards=(str(tmp_path / "bad"),))
        config = JobConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__},
                              "datasets": (*config.datasets, bad)})
    original = Job(config, snapshot_every=2)
    num_steps = original.plan_all()
    per_step = [[(doc.dataset, doc.key) for doc in original.step_plan(s).documents()] for s in range(num_steps)]
    assert [d for step in per_step for d in step] == _drawn(Job(config))
    reseeded = JobConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__}, "seed": 1})
    assert _drawn(Job(reseeded)) != [d for step in per_step for d in step]
    middle = num_steps // 2 + 1  # inside the second epoch's first pass or later
    for rank in range(config.dp_size):
        original.acknowledge(rank, middle)
    state = json.loads(json.dumps(original.state_dict()))
    start = state["snapshot_step"]
    assert 0 < start <= middle
    resumed = Job(config)
    resumed.load_state_dict(state)
    got = [[(doc.dataset, doc.key) for doc in resumed.step_plan(s).documents()] for s in range(middle, num_steps)]
    assert got == per_step[middle:] and resumed.step_plan(num_steps) is None


def test_per_dataset_settings_apply_to_that_dataset_only(tmp_path):
    config = _mixture(tmp_path, sizes=(1, 1))
    small = ImageConfig(max_pixels=16 * 28 * 28)
    config = JobConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__},
                          "datasets": (config.datasets[0],
                                       DatasetConfig(name="ds1", shards=config.datasets[1].shards, image=small,
                                                     modalities=("text",)))})
    job = Job(config)
    job.plan_all()
    docs = [doc for s in range(job.num_steps()) for doc in job.step_plan(s).documents()]
    assert any(img.tokens > 16 for doc in docs if doc.dataset == 0 for img in doc.images)
    assert all(not doc.images for doc in docs if doc.dataset == 1), "text only"


def test_mixture_files_and_their_errors(tmp_path):
    (tmp_path / "mix.yaml").write_text("mix_by: tokens\ndatasets:\n"
                                       "  - {name: web, shards: 'web/{00000..00001}.tar', weight: 3}\n"
                                       "  - {name: speech, shards: [/abs/speech.tar], modalities: [text, audio],"
                                       " image: {max_pixels: 50000}, generate: none}\n")
    mix = load_mixture(tmp_path / "mix.yaml")
    assert mix["mix_by"] == "tokens"
    web, speech = mix["datasets"]
    assert web.shards == (str(tmp_path / "web/{00000..00001}.tar"),) and web.weight == 3.0
    assert speech.shards == ("/abs/speech.tar",) and speech.image.max_pixels == 50000
    (tmp_path / "mix.json").write_text(json.dumps([{"name": "a", "shards": "http://h/a.tar"}]))
    assert load_mixture(tmp_path / "mix.json")["datasets"][0].shards == ("http://h/a.tar",)
    for bad, message in (({"datasets": []}, "non-empty"), ([{"name": "a"}], "shards"),
                         ([{"name": "a b", "shards": "x"}], "name"), ([{"name": "a", "shards": "x", "weight": 0}],
                                                                     "weight"),
                         ([{"name": "a", "shards": "x", "colour": 1}], "unknown keys"),
                         ({"datasets": [{"name": "a", "shards": "x"}], "mix_by": "bytes"}, "mix_by")):
        with pytest.raises(ConfigError, match=message):
            JobConfig(**parse_mixture(bad))
    with pytest.raises(ConfigError, match="distinct"):
        JobConfig(**parse_mixture([{"name": "a", "shards": "x"}, {"name": "a", "shards": "y"}]))
    with pytest.raises(ConfigError, match="not both"):
        JobConfig(shards=("x",), datasets=(DatasetConfig(name="a", shards=("y",)),))


def test_a_shard_in_two_datasets_is_refused(tmp_path):
    write_tiny_shards(tmp_path, num_shards=1)
    config = JobConfig(datasets=(DatasetConfig(name="a", shards=(str(tmp_path),)),
                                 DatasetConfig(name="b", shards=(str(tmp_path / "00000.tar"),))))
    with pytest.raises(ConfigError, match="is in datasets 'a' and 'b'"):
        Job(config)


def test_a_dataset_s_modalities_hide_the_other_members_even_where_the_json_names_them():
    import io

    import soundfile

    from disttrain_api.config import AudioConfig, GenerationConfig
    from helpers import jpeg_bytes
    from preprocess_service.adapters.media.parse import parse_document
    from preprocess_service.core.sample import AudioRef, ImageRef, TextSegment
    from preprocess_service.core.tokenizer import ByteTokenizer

    wav = io.BytesIO()
    soundfile.write(wav, np.zeros(16000, dtype=np.float32), 16000, format="WAV")
    sample = {"__key__": "k", "jpg": jpeg_bytes(64, 64), "wav": wav.getvalue(), "txt": b"a caption",
              "json": json.dumps({"order": ["wav", "txt", "jpg"], "generate": []}).encode()}
    conversation = {"__key__": "c", "jpg": jpeg_bytes(64, 64), "json": json.dumps({"conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A square."}]}).encode()}

    def parse(raw, kinds):
        return parse_document(raw, image_config=ImageConfig(), tokenizer=ByteTokenizer(), seq_len=4096,
                              audio_config=AudioConfig(), generation=GenerationConfig(),
                              modalities=None if kinds is None else frozenset(kinds))

    assert [type(s) for s in parse(sample, None).segments] == [AudioRef, TextSegment, ImageRef]
    assert [type(s) for s in parse(sample, ("text", "image")).segments] == [TextSegment, ImageRef]
    assert [type(s) for s in parse(sample, ("image", "audio")).segments] == [AudioRef, ImageRef]
    text_only = parse(conversation, ("text",))
    assert all(isinstance(s, TextSegment) for s in text_only.segments) and text_only.text_tokens > 0
    assert any(isinstance(s, ImageRef) for s in parse(conversation, None).segments)


@pytest.mark.parametrize("rule", [{"mix_by": "tokens"}, {"mix_epoch": "all_exhausted"}],
                         ids=["tokens", "all_exhausted"])
def test_a_mixture_planner_passes_the_state_round_trip_harness(tmp_path, rule):
    """The planner of a two-dataset mixture (its blend, per-dataset cursors, shuffle buffers and
    packer inside its state) resumed from its state at any of several steps plans what the
    original planned from there, through the harness every stateful part shares."""
    config = _mixture(tmp_path, sizes=(2, 1), weights=(0.6, 0.4), num_epochs=2, **rule)
    job = Job(config)  # its shard lists and parse function

    def make():
        return EpochPlanner(config, job.dataset_urls, Documents(job.reader, job.documents.parse_only))

    def advance(planner):
        plan = planner.next_plan()
        return None if plan is None else [(d.dataset, d.key) for d in plan.documents()]

    steps, states = check_resumes(make, advance, at=lambda n: (1, n // 3, n // 2, n - 1))
    assert len({d for step in steps for d, _ in step}) == 2 and states[-1]["anchor"]["datasets"]


def test_seeking_a_cursor_by_position_continues_as_reading_up_to_it_does():
    """Waves of open shards read in rounds: where reading stands after p samples is a function of p
    and the shards' sizes (mixture.seek_cursor), so a far position is reached without reading."""
    from preprocess_service.core.mixture import DatasetCursor, seek_cursor

    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 9, size=23)
    sizes[5] = 0  # an empty shard
    urls = [f"s{i}" for i in range(len(sizes))]
    config = JobConfig(shards=tuple(urls), seed=4)

    def read(cursor, k, limit=None):
        """(shard, sample index) in reading order, reading shards of ``sizes`` through the cursor's turns."""
        out = []
        while (slot := cursor.slot(k)) is not None and (limit is None or len(out) < limit):
            size = sizes[urls.index(cursor.order[slot.position])]
            ended = slot.samples >= size
            if not ended:
                out.append((cursor.order[slot.position], slot.samples))
                slot.samples += 1
            cursor.advance(ended)
        return out

    for k in (1, 3, 8):
        whole = DatasetCursor(urls, 0)
        whole.start_pass(config, 0, 0)
        everything = read(whole, k)
        assert len(everything) == sizes.sum() and len(set(everything)) == len(everything)
        for p in {0, 1, 2, 7, 30, 31, len(everything) // 2, len(everything) - 1, len(everything)}:
            cursor = DatasetCursor(urls, 0)
            cursor.start_pass(config, 0, 0)
            seek_cursor(cursor, sizes, k, p)
            assert read(cursor, k) == everything[p:], (k, p)
