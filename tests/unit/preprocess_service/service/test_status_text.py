"""What ``status --job-id`` prints of a job's report: its plugins' CPU per sample among the rest."""

from disttrain_api import preprocess_pb2 as pb
from preprocess_service.service.cli import _status_text


def test_status_shows_each_plugin_hooks_cpu_per_sample_or_item():
    info = pb.JobInfo(job_id="j1", num_steps=3, num_shards=2,
                      spec=pb.JobSpec(dp_size=2, num_microbatches=4, seqs_per_microbatch=1, seq_len=2048))
    report = pb.JobReport(job_id="j1", num_planned_steps=3, planning_done=True, num_sent_microbatches=8,
                          plugins=[pb.PluginCost(plugin="clip_filter", hook="sample", cpu_s=0.25, calls=500),
                                   pb.PluginCost(plugin="random_crop", hook="media", cpu_s=1.2, calls=400)])
    text = _status_text(info, report)
    assert "plugin   clip_filter (sample hook): 0.500 ms CPU per sample over 500 samples" in text
    assert "plugin   random_crop (media hook): 3.000 ms CPU per item over 400 items" in text
    assert "plugin" not in _status_text(info, pb.JobReport(job_id="j1"))
