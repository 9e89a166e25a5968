"""One sample's content: parsing a shard's files into documents, conversations, image and audio
headers and decoders, and the job's text tokenizers."""
