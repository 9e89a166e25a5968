"""Reading shards: where their bytes come from (sources, remote, the shard cache), the tar stream,
and img2dataset's side files (parquet, stats)."""
