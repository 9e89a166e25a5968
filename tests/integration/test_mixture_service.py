"""A mixture and a trained tokenizer through the real service: gRPC, client processes, the
tokenizer described in JobInfo, every sample tagged with its dataset and delivered as planned."""


from disttrain_api.config import DatasetConfig, JobConfig
from disttrain_tools.runner import run_job, summary
from helpers import write_tiny_shards
from preprocess_service.adapters.media.tokenizers import train_bpe


def test_a_mixture_with_a_bpe_tokenizer_runs_end_to_end(tmp_path):
    import grpc

    from disttrain_api import preprocess_pb2 as pb
    from disttrain_api import preprocess_pb2_grpc as pb_grpc
    from disttrain_api.spec import spec_from_config
    from preprocess_service.service.server import create_server

    for name, seed in (("web", 0), ("books", 1)):
        write_tiny_shards(tmp_path / name, num_shards=2, samples_per_shard=15, seed=seed)  # the same keys in both
    bpe = train_bpe([f"caption of sample {i:09d} " * 3 for i in range(300)], tmp_path / "bpe.json", vocab_size=300)
    config = JobConfig(datasets=(DatasetConfig(name="web", shards=(str(tmp_path / "web"),), weight=2),
                                 DatasetConfig(name="books", shards=(str(tmp_path / "books"),), modalities=("text",))),
                       mix_epoch="all_exhausted", seq_len=1024, dp_size=2, num_microbatches=2, tokenizer=f"hf:{bpe}")
    server, port, _ = create_server("127.0.0.1:0", decode_workers=1)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = pb_grpc.PreprocessStub(channel).OpenJob(pb.OpenJobRequest(spec=spec_from_config(config)))
        assert info.tokenizer.kind == "hf" and info.tokenizer.vocab_size > 300
        assert info.tokenizer.image_id >= 300 and "<|image|>" in info.tokenizer.added_tokens
        assert [d.name for d in info.spec.datasets] == ["web", "books"] and len(info.shard_urls) == 4
        result = run_job(config, address=f"127.0.0.1:{port}", progress=False)
        from trainer import train  # the trainer sizes its embeddings from JobInfo

        args = train.parse(["--address", f"127.0.0.1:{port}", "--shards", str(tmp_path / "web"), "--seq-len", "1024",
                            "--tokenizer", f"hf:{bpe}"])
        assert train.job_vocab_size(args) == info.tokenizer.vocab_size
    finally:
        server.stop(grace=1).wait()
    check = result.exactly_once()
    assert check["ok"], check
    delivered = result.received
    web = sum(n for k, n in delivered.items() if k.startswith("web/"))
    books = sum(n for k, n in delivered.items() if k.startswith("books/"))
    # books (a third of the weight) read through once; web kept at twice its count, so read twice over
    assert books == 30 and abs(web - 60) <= 1, (web, books)
    restarts = result.datasets[0]["restarts"]
    assert restarts >= 1 and max(n for k, n in delivered.items() if k.startswith("web/")) <= 1 + restarts
    assert max(n for k, n in delivered.items() if k.startswith("books/")) == 1
    text = summary(result, config)
    assert "web" in text and "66.7%" in text
