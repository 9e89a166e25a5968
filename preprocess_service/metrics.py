"""Prometheus metrics of a service process (``serve --metrics-port``, default 9400, path /metrics).

Counters and gauges live in prometheus_client's process-wide registry, which is the usual
layout for one server per process; the server and the Redis store update them where the events
happen. Names, with the PromQL a dashboard would use:

- ``disttrain_items_sent_total{modality}``: samples, images, audio clips and images to
  generate sent to trainers (``rate(...[1m])`` = samples/s per modality);
- ``disttrain_microbatches_sent_total``, ``disttrain_sent_bytes_total``;
- ``disttrain_decode_errors_total{reason,stage}``: samples skipped, by reason, when planning
  (metadata, text, headers) or decoding (pixels, audio);
- ``disttrain_queue_depth{queue}``: microbatches in decode (``decode``) and prepared, waiting for
  gRPC (``send``), over all streams;
- ``disttrain_active_streams``;
- ``disttrain_step_dp_imbalance{job}``: max/mean planned rank load of the last step sent;
- ``disttrain_step_bubble_fraction{job,source}``: the simulator's predicted idle share of the
  last step sent (``predicted``) and the one the trainer measured and reported (``measured``);
- ``disttrain_stream_lag_steps{job,rank}``: steps a rank's stream is behind the job's furthest rank;
- ``disttrain_redis_round_trip_seconds``: histogram of Redis round trips (pipelines, scripts).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from preprocess_service.errors import ConfigError

ITEMS_SENT = Counter("disttrain_items_sent", "Items sent to trainers, by modality "
                     "(sample, image, audio, generation)", ["modality"])
MICROBATCHES_SENT = Counter("disttrain_microbatches_sent", "Microbatches sent to trainers")
BYTES_SENT = Counter("disttrain_sent_bytes", "Microbatch payload bytes sent to trainers")
DECODE_ERRORS = Counter("disttrain_decode_errors", "Samples skipped, by reason (errors.SampleError.KINDS) and "
                        "stage: plan (parsing metadata, text, image headers) or decode (pixels, audio)",
                        ["reason", "stage"])
QUEUE_DEPTH = Gauge("disttrain_queue_depth", "Microbatches in a queue, over all streams", ["queue"])
ACTIVE_STREAMS = Gauge("disttrain_active_streams", "Open microbatch streams")
DP_IMBALANCE = Gauge("disttrain_step_dp_imbalance", "Max/mean planned rank load of the last step sent", ["job"])
BUBBLE = Gauge("disttrain_step_bubble_fraction", "Idle share of the pipeline in the last step: the simulator's "
               "prediction or the trainer's measurement", ["job", "source"])
STREAM_LAG = Gauge("disttrain_stream_lag_steps", "Steps a rank's stream is behind the job's furthest rank",
                   ["job", "rank"])
REDIS_LATENCY = Histogram("disttrain_redis_round_trip_seconds", "Redis round trips (one pipeline or script)",
                          buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))

for _modality in ("sample", "image", "audio", "generation"):
    ITEMS_SENT.labels(_modality)
for _queue in ("decode", "send"):
    QUEUE_DEPTH.labels(_queue)


def serve(port: int, host: str = "0.0.0.0"):
    """Starts the /metrics HTTP endpoint in a daemon thread; returns (server, thread)."""
    try:
        return start_http_server(port, addr=host)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror} (set metrics_port, 0 = off)") from None


def microbatch_sent(arrays, nbytes: int) -> None:
    """Counts one microbatch message (assemble.MicrobatchArrays) as it is handed to gRPC."""
    MICROBATCHES_SENT.inc()
    BYTES_SENT.inc(nbytes)
    ITEMS_SENT.labels("sample").inc(len(arrays.sample_keys))
    for modality, name in (("image", "image_spans"), ("audio", "audio_spans"), ("generation", "gen_spans")):
        if name in arrays.arrays:
            ITEMS_SENT.labels(modality).inc(len(arrays.arrays[name]))
    for record in arrays.skipped:
        DECODE_ERRORS.labels(record.kind, "decode").inc()


def step_planned(job_id: str, plan) -> None:
    """Sets the step gauges from a StepPlan as its first microbatch goes out."""
    DP_IMBALANCE.labels(job_id).set(plan.imbalance()[0])
    if "bubble_fraction" in plan.simulation:
        BUBBLE.labels(job_id, "predicted").set(plan.simulation["bubble_fraction"])


def bubble_measured(job_id: str, fraction: float) -> None:
    BUBBLE.labels(job_id, "measured").set(fraction)


class StreamLag:
    """Per job, the last step sent to each rank; the lag gauge is the furthest rank's minus this one's."""

    def __init__(self):
        self._sent: dict[str, dict[int, int]] = {}

    def step_sent(self, job_id: str, rank: int, step: int) -> None:
        sent = self._sent.setdefault(job_id, {})
        sent[rank] = max(step, sent.get(rank, -1))
        front = max(sent.values())
        for r, s in sent.items():
            STREAM_LAG.labels(job_id, str(r)).set(front - s)
